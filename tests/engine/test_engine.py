"""The retrieval engine on a tiny model saved to a folder and the real default embedder."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import FACTS, byte_tokenizer, edit_manifest, in_threads, save_tiny

from kvrag.engine.documents import DocumentError, split_text
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.errors import EmptyInputError, IndexLoadError, InvalidRequestError, NoMatchError
from kvrag.model.kvmodel import Answer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(folder)
    return folder


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture
def rag(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", lambda name=None, device="cpu": _shared_embedder(name))
    engine = KVRAG.from_defaults(
        tmp_path / "index", model=str(model_dir), chunk_tokens=120, overlap=8, cache_dir=tmp_path / "cache"
    )
    engine.ingest(FACTS, progress=False)
    return engine


_EMBEDDERS = {}


def _shared_embedder(name):
    if name not in _EMBEDDERS:
        _EMBEDDERS[name] = Embedder(name)
    return _EMBEDDERS[name]


def test_reingesting_encodes_nothing_and_deleting_removes_everything(rag):
    again = rag.ingest(FACTS, progress=False)
    assert again.encoded == 0 and again.store_hits == again.chunks == 5
    assert rag.info()["chunks"] == 5 and rag.info()["kv_entries"] == 5
    doc = rag.retrieve("lighthouse Karsa", top_k=1)[0].id.split("#")[0]
    assert rag.delete(doc) == 1
    info = rag.info()
    assert info["chunks"] == 4 and info["kv_entries"] == 4 and info["documents"] == 4
    assert all(not s.id.startswith(doc) for s in rag.retrieve("lighthouse Karsa", top_k=5))


def test_the_sources_read_are_the_chunks_the_answering_prompt_held(rag):
    question = "Who runs Velloria's harbour?"
    one = rag.query(question, top_k=3, strategy="target_only", max_new_tokens=4)
    assert len(one.stats.order) == 1 and [s.read for s in one.sources] == [i in one.stats.order for i in range(3)]
    assert one.read == [one.sources[one.stats.order[0]]]
    assert [s["read"] for s in one.to_dict()["sources"]] == [s.read for s in one.sources]
    *_, streamed = rag.stream(question, top_k=3, strategy="target_only", max_new_tokens=4)
    assert [s.read for s in streamed.sources] == [s.read for s in one.sources]
    full = rag.query(question, top_k=3, strategy="full_prefill", max_new_tokens=4)
    assert all(s.read for s in full.sources) and len(full.read) == 3
    given = rag.answer(question, rag.retrieve(question, top_k=3), strategy="target_only", max_new_tokens=4)
    assert [s.read for s in given.sources] == [s.read for s in one.sources]
    both = "Who runs Velloria's harbour, and when does the river Tam flood?"
    parts = rag.query(both, top_k=3, strategy="target_only", parts="auto", max_new_tokens=4)
    assert len(parts.parts) == 2
    for part in parts.parts:  # each part marked from its own order, on sources of its own
        assert [s.read for s in part.sources] == [i in part.stats.order for i in range(len(part.sources))]
    held = {p.sources[i].id for p in parts.parts for i in p.stats.order}
    assert {s.id for s in parts.read} == held and all(s.read == (s.id in held) for s in parts.sources)


def test_mark_read_takes_a_hop_parts_own_retrieval():
    from kvrag.answer import Answer, AnswerStats, Source
    from kvrag.engine.query import mark_read

    def answer(sources, order, parts=()):
        stats = AnswerStats.without_chunks("target_only", order=order)
        return Answer("x", [], "eos", stats, sources=sources, parts=list(parts))

    first = [Source("a#0", "A", 0.9), Source("b#0", "B", 0.5)]
    hop = [Source("c#0", "C", 0.8), Source("b#0", "B", 0.7)]
    whole = answer([*first, hop[0]], [1], [answer(list(first), [0]), answer(list(hop), [0])])
    mark_read(whole)
    assert [s.id for s in whole.read] == ["a#0", "c#0"]
    assert [s.read for s in whole.parts[0].sources] == [True, False]
    assert [s.read for s in whole.parts[1].sources] == [True, False] and not first[0].read  # new objects


def test_retrieval_filters_apply_before_top_k(rag):
    hits = rag.retrieve("Who built it?", top_k=3, filters={"topic": "buildings", "lang": "en"})
    assert len(hits) == 2 and all(h.metadata["topic"] == "buildings" for h in hits)
    assert len(rag.retrieve("anything", top_k=10, filters={"topic": ["ports", "rivers"]})) == 2
    assert rag.retrieve("anything", top_k=3, filters={"topic": "none"}) == []
    dense = rag.retrieve("When does the river Tam flood?", top_k=2)
    hybrid = rag.retrieve("When does the river Tam flood?", top_k=2, bm25=True)
    assert dense[0].text.startswith("The river Tam") and hybrid[0].text.startswith("The river Tam")
    assert dense[0].score > dense[1].score


def test_query_returns_sources_and_stats(rag):
    a = rag.query("Who runs Velloria's harbour?", top_k=3, max_new_tokens=6)
    assert [s.id for s in a.sources] and a.sources[0].text.startswith("Velloria")
    assert a.stats.store_hits == 3 and a.stats.chunks_encoded == 0 and a.stats.target == 0
    assert 0 < a.stats.retrieve_s < a.stats.ttft_s
    d = a.to_dict()
    assert set(d) == {"text", "finish_reason", "abstained", "sources", "stats"} and json.dumps(d)
    *pieces, final = list(rag.stream("Who runs Velloria's harbour?", top_k=3, max_new_tokens=6))
    assert isinstance(final, Answer) and "".join(pieces) == final.text == a.text


def test_answer_over_given_chunks_uses_the_store(rag):
    a = rag.answer("Who built the lighthouse?", [FACTS[0][0], "An unseen text about nothing."], max_new_tokens=4)
    assert a.stats.store_hits == 1 and a.stats.chunks_encoded == 1
    again = rag.answer("Who built the lighthouse?", [FACTS[0][0], "An unseen text about nothing."], max_new_tokens=4)
    assert again.stats.store_hits == 2 and again.stats.chunks_encoded == 0  # the miss was stored
    stored = rag.store_kv(["Yet another unseen text.", "Yet another unseen text.", FACTS[1][0]])
    assert stored.encoded == 1 and stored.store_hits == 2
    assert a.sources[0].metadata["topic"] == "buildings" and a.sources[1].id == "given#1"


def test_answer_over_retrieved_sources_equals_query_and_keeps_their_ids_and_scores(rag):
    question = "Who built the lighthouse?"
    expected = rag.query(question, top_k=3, max_new_tokens=4)
    sources = rag.retrieve(question, top_k=3)
    answer = rag.answer(question, sources, max_new_tokens=4, retrieve_s=0.25)
    assert answer.token_ids == expected.token_ids and answer.sources == expected.sources
    assert answer.stats.order == expected.stats.order and answer.stats.retrieve_s >= 0.25


def test_filters_that_match_nothing_raise_no_match_and_bad_filters_are_refused(rag):
    with pytest.raises(NoMatchError, match="no chunk matches the filters"):
        rag.query("Who built the lighthouse?", filters={"topic": "none"})
    for bad, phrase in [("x", "filters is a str"), ({"topic": {"$in": ["a"]}}, "filter 'topic' wants")]:
        with pytest.raises(InvalidRequestError, match=phrase):
            rag.retrieve("Who built the lighthouse?", filters=bad)


def test_four_threads_answer_as_one_thread_does(rag):
    questions = ["Who runs the harbour?", "When was the lighthouse built?", "What floods?", "What does the mill grind?"]
    serial = [rag.query(q, top_k=3, max_new_tokens=6).token_ids for q in questions]
    assert in_threads(lambda i: rag.query(questions[i], top_k=3, max_new_tokens=6).token_ids, 4) == serial


def test_async_query_and_stream_do_not_block_the_loop(rag):
    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        answer = await rag.aquery("Who runs the harbour?", top_k=3, max_new_tokens=8)
        items = [item async for item in rag.astream("Who runs the harbour?", top_k=3, max_new_tokens=8)]
        task.cancel()
        return answer, items, ticks

    answer, items, ticks = asyncio.run(main())
    assert isinstance(items[-1], Answer) and items[-1].text == answer.text and ticks > 0


def test_a_damaged_entry_is_re_encoded_and_the_answer_is_unchanged(rag):
    q = "Who runs Velloria's harbour?"
    before = rag.query(q, top_k=2, max_new_tokens=6)
    key = rag.index.records[before.sources[0].id].key
    path = next(Path(rag.path, "kv").rglob(f"{key}*.safetensors"))
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    path.write_bytes(bytes(blob))
    rag.store.front.delete(key)  # drop the in-memory copy so the disk entry is read
    after = rag.query(q, top_k=2, max_new_tokens=6)
    assert after.stats.chunks_encoded == 1 and after.stats.store_hits == 1
    assert after.token_ids == before.token_ids


def test_a_second_process_answers_with_zero_encodings(rag, model_dir):
    first = rag.query("Who built the lighthouse?", top_k=3, max_new_tokens=6)
    script = (
        "import json, sys\n"
        "from kvrag.engine.rag import KVRAG\n"
        f"rag = KVRAG.load({str(rag.path)!r}, cache_dir={str(rag.path.parent / 'cache')!r})\n"
        "a = rag.query('Who built the lighthouse?', top_k=3, max_new_tokens=6)\n"
        "print(json.dumps({'encoded': a.stats.chunks_encoded, 'hits': a.stats.store_hits, 'tokens': a.token_ids}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"encoded": 0, "hits": 3, "tokens": first.token_ids}


def test_an_index_of_another_model_is_refused(rag, tmp_path):
    edit_manifest(rag.path, fingerprint="0" * 64)
    with pytest.raises(IndexLoadError, match="built with another model"):
        KVRAG.load(rag.path, cache_dir=tmp_path / "cache")
    with pytest.raises(IndexLoadError, match="no kvrag index"):
        KVRAG.load(tmp_path / "nowhere")


def test_a_path_with_no_index_is_refused_by_name_when_not_to_be_created(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", lambda name=None, device="cpu": _shared_embedder(name))
    typo = tmp_path / "typo-indx"
    with pytest.raises(IndexLoadError, match=f"no kvrag index at {typo}: check the path"):
        KVRAG.from_defaults(typo, model=str(model_dir), create=False)
    assert not typo.exists()  # nothing was made there
    empty = KVRAG.from_defaults(typo, model=str(model_dir), cache_dir=tmp_path / "cache")  # create=True: a new one
    with pytest.raises(EmptyInputError, match=f"the index at {typo} holds no chunks: ingest documents first"):
        empty.query("Who runs the harbour?")


def test_files_and_bad_documents(rag, tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.md").write_text("# Notes\n\nThe bell of Orrin rings at dawn.")
    (folder / "b.rst").write_text("Orrin\n=====\n\nThe square of Orrin has a fountain.")
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    stats = rag.ingest(folder, progress=False)
    assert stats.documents == 2 and rag.retrieve("bell of Orrin", top_k=1)[0].metadata["source"].endswith("a.md")
    assert [(s.path, s.reason.split(" (")[0]) for s in stats.skipped] == [(str(folder / "skip.bin"), "binary, or text not in UTF-8")]
    (folder / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DocumentError, match="nothing to ingest: every file was skipped: .*latin1.txt: not UTF-8"):
        rag.ingest(folder / "latin1.txt")
    with pytest.raises(DocumentError, match="skip.bin: binary"):
        rag.ingest(folder / "skip.bin")
    with pytest.raises(DocumentError, match="2 file.s. could not be read, and the ingest is strict"):
        rag.ingest(folder, progress=False, strict=True)
    with pytest.raises(EmptyInputError, match="empty"):
        rag.ingest(["   "])
    with pytest.raises(InvalidRequestError, match="cannot ingest a int"):
        rag.ingest([3])
    from kvrag.engine.documents import to_documents

    assert [d.text for d in to_documents(("one text", "another text"))] == ["one text", "another text"]
    assert to_documents(("a text", {"k": 1}))[0].metadata == {"k": 1}
    with pytest.raises(InvalidRequestError, match="top_k"):
        rag.retrieve("q", top_k=0)


def test_progress_is_reported(rag):
    seen = []
    rag.ingest(
        [("A brand new fact about the tower of Quell.", {})],
        progress=False,
        on_progress=lambda done, total: seen.append((done, total)),
    )
    assert seen == [(0, 1), (1, 1)]  # the plan before encoding, then each batch


def test_splitter_windows_overlap_and_keep_the_text(embedder):
    tok = byte_tokenizer()
    text = " ".join(f"Sentence number {i} says something." for i in range(60))
    chunks = split_text(text, tok, chunk_tokens=120, overlap=20)
    assert len(chunks) > 5 and all(len(tok(c, add_special_tokens=False)["input_ids"]) <= 120 for c in chunks)
    assert all(c in text for c in chunks)
    assert all(a[-10:] in text[text.index(a) : text.index(a) + len(a) + 200] for a in chunks)
    for a, b in zip(chunks, chunks[1:]):
        assert text.index(b) < text.index(a) + len(a)  # consecutive windows overlap
    with pytest.raises(InvalidRequestError, match="overlap"):
        split_text(text, tok, chunk_tokens=40, overlap=30)


def test_redis_going_down_mid_service_recomputes_with_a_warning(model_dir, tmp_path, monkeypatch):
    from redis_server import RedisServer

    from kvrag.cache.store import MemoryStore, RedisStore, TieredStore
    from kvrag.engine.rag import StoreWarning

    monkeypatch.setattr("kvrag.engine.rag.Embedder", lambda name=None, device="cpu": _shared_embedder(name))
    server = RedisServer()
    try:
        store = TieredStore(MemoryStore(), RedisStore(server.url, namespace="down-test"))
        engine = KVRAG.from_defaults(
            None, model=str(model_dir), store=store, chunk_tokens=120, overlap=8, cache_dir=tmp_path / "cache"
        )
        engine.ingest(FACTS, progress=False)
        before = engine.query("Who runs Velloria's harbour?", top_k=2, max_new_tokens=6)
    finally:
        server.stop()
    for key in list(store.front.keys()):
        store.front.delete(key)
    with pytest.warns(StoreWarning) as caught:
        after = engine.query("Who runs Velloria's harbour?", top_k=2, max_new_tokens=6)
    messages = [str(w.message) for w in caught]
    assert any("recomputing the chunk" in m for m in messages) and any("could not store" in m for m in messages)
    assert after.stats.chunks_encoded == 2 and after.token_ids == before.token_ids
