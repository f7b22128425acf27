"""Bad input through the engine's API and the CLI: each case ends in a clear typed error (its key phrase
asserted) or a correct answer, and nothing is half-ingested; a fuzz run of the CLI's arguments. (The stores',
the planner's, the request's and the file parser's own bad input is tested beside each of them.)"""

import math
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import FACTS, HashEmbedder, byte_tokenizer, save_tiny, tiny_config

from kvrag import Document, KVModel
from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
from kvrag.cli import main
from kvrag.engine.rag import KVRAG
from kvrag.errors import (
    ContextOverflowError,
    DocumentError,
    EmptyInputError,
    InvalidRequestError,
)

Q = "Who runs Velloria's harbour?"


@pytest.fixture(autouse=True)
def hash_embedder(monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", HashEmbedder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


LOAD = KVModel.from_pretrained


@cache
def shared_kv(folder):
    return LOAD(folder)


@pytest.fixture
def rag(model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.KVModel.from_pretrained", lambda name, **kw: shared_kv(str(model_dir)))
    engine = KVRAG.from_defaults(tmp_path / "index", model=str(model_dir), chunk_tokens=120, overlap=8)
    engine.ingest(FACTS, progress=False)
    return engine


def cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:  # argparse's own usage errors
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


# -- documents ---------------------------------------------------------------------------------------------

EMPTY = {
    "empty str": "",
    "whitespace str": " \n\t  ",
    "empty Document": Document(""),
    "whitespace pair": ("\n\n", {"k": 1}),
}


@pytest.mark.parametrize("name", sorted(EMPTY))
def test_empty_and_whitespace_documents_are_refused_and_nothing_is_ingested(rag, name):
    with pytest.raises(EmptyInputError, match="empty or whitespace only"):
        rag.ingest([FACTS[0][0] + " again", EMPTY[name]], progress=False)
    assert len(rag.index) == len(FACTS)


@pytest.mark.parametrize("content", [b"", b"   \n\t\n", "caf\xe9".encode("latin-1"), "text".encode("utf-16"),
                                     b"\xff\xfe\x00\x01binary"])  # fmt: skip
def test_empty_and_non_utf8_files_are_skipped_and_named_through_the_api_and_the_cli(rag, tmp_path, capsys, content):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "good.md").write_text("The bell of Orrin rings at dawn.")
    (folder / "bad.txt").write_bytes(content)
    phrase = "empty or whitespace only" if not content.strip() else "NUL bytes" if b"\x00" in content else "not UTF-8"
    with pytest.raises(DocumentError, match=f"strict .nothing was ingested.: .*bad.txt: .*{phrase}"):
        rag.ingest(folder, progress=False, strict=True)
    assert len(rag.index) == len(FACTS)  # strict: not even good.md
    code, _, err = cli(capsys, "ingest", folder, "--index", rag.path, "--quiet", "--strict")
    assert code == 2 and phrase in err and "bad.txt" in err and err.count("\n") == 1
    code, out, err = cli(capsys, "ingest", folder, "--index", rag.path, "--quiet")
    assert code == 0 and "1 documents" in out and len(rag.index) == len(FACTS)  # (this engine's view is older)
    lines = err.splitlines()
    assert lines[0] == "kvrag: skipped 1 file(s), not ingested (--strict refuses them):" and len(lines) == 2
    assert lines[1].startswith(f"  {folder / 'bad.txt'}: ") and phrase in lines[1]
    code, _, err = cli(capsys, "ingest", folder / "bad.txt", "--index", rag.path, "--quiet")
    assert code == 2 and "nothing to ingest: every file was skipped" in err and err.count("\n") == 1


def test_text_that_is_not_unicode_is_refused_everywhere(rag, capsys):
    broken = "caf\udce9 au lait"  # what undecodable bytes become in argv, file names and surrogateescape reads
    for call in (
        lambda: rag.ingest([broken], progress=False),
        lambda: rag.query("Who runs \udcff the harbour?"),
        lambda: rag.answer(Q, [broken]),
        lambda: rag.kvmodel.encode([broken]),
        lambda: rag.store_kv([broken]),
    ):
        with pytest.raises(InvalidRequestError, match="not valid Unicode"):
            call()
    code, _, err = cli(capsys, "ask", "Who runs \udcff the harbour?", "--index", rag.path)
    assert code == 2 and "not valid Unicode" in err


def test_a_document_that_is_not_text_is_refused(rag):
    with pytest.raises(InvalidRequestError, match="give it a str"):
        rag.ingest([Document(b"bytes")], progress=False)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="cannot ingest a NoneType"):
        rag.ingest([None], progress=False)  # type: ignore[list-item]


def test_a_5_mb_document_through_the_api_and_the_cli(tmp_path, capsys, monkeypatch):
    """Ingested in bounded memory, retrievable, answered; as one chunk it is a clear overflow error."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    micro = AutoModelForCausalLM.from_config(
        tiny_config(
            "llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).eval()
    micro.save_pretrained(tmp_path / "micro")
    byte_tokenizer().save_pretrained(tmp_path / "micro")
    line = "Harbour log: the tide turned, the ships came in, the keeper wrote it down. "
    body = line * (5_000_000 // len(line) + 1)  # repetitive: identical chunks are encoded once (kept fast)
    middle = len(body) // 2
    text = body[:middle] + "\n\nThe secret harbour word is zebraquartz.\n\n" + body[middle:]
    assert len(text.encode()) >= 5_000_000
    big = tmp_path / "big.txt"
    big.write_text(text)

    index = tmp_path / "index"
    rag = KVRAG.from_defaults(index, model=str(tmp_path / "micro"), chunk_tokens=400, overlap=8,
                              store=TieredStore(MemoryStore(4 << 20), DiskStore(index / "kv", "int8")))  # fmt: skip
    rag.kvmodel.batch_tokens = 1 << 16
    import kvrag.model.runtime  # the one encoding set-up

    real_encode, calls = kvrag.model.runtime.encode_runs, []

    def recording(model, prefix, runs, **kw):
        calls.append(sum(len(ids) for run in runs for ids in run))
        return real_encode(model, prefix, runs, **kw)

    monkeypatch.setattr(kvrag.model.runtime, "encode_runs", recording)
    stats = rag.ingest(big, progress=False)
    monkeypatch.setattr(kvrag.model.runtime, "encode_runs", real_encode)
    assert stats.documents == 1 and stats.tokens > 5_000_000 and stats.chunks > 12_000
    # Ingestion holds one group's KV at a time (about one encoding forward), never the whole document's.
    assert (
        0 < stats.encoded < stats.chunks and sum(calls) < stats.tokens and max(calls) <= rag.kvmodel.batch_tokens + 400
    )
    assert rag.store.front.nbytes <= 4 << 20
    with pytest.raises(ContextOverflowError, match="split it"):
        rag.ingest(Document(text, id="whole"), split=False, progress=False)

    answer = rag.query("What is the secret harbour word zebraquartz?", top_k=1, max_new_tokens=4)
    assert "zebraquartz" in answer.sources[0].text and answer.stats.chunks_encoded == 0
    fresh = rag.kvmodel.answer(
        "What is the secret harbour word zebraquartz?", [answer.sources[0].text], max_new_tokens=4
    )
    assert abs(len(answer.token_ids) - len(fresh.token_ids)) <= 4  # int8 KV: an answer, of the same length bound

    code, out, err = cli(capsys, "ingest", big, "--index", index, "--quiet")
    assert code == 0 and f"already stored for {stats.chunks}" in out, err
    code, out, err = cli(capsys, "ask", "secret harbour word zebraquartz", "--index", index, "--top-k", "1", "--json",
                         "--max-new-tokens", "2")  # fmt: skip
    assert code == 0 and "zebraquartz" in __import__("json").loads(out)["sources"][0]["text"]


# -- questions, top_k, budget ------------------------------------------------------------------------------


def test_a_question_longer_than_the_context(rag, capsys):
    long = "Why " * 200 + "?"
    for call in (lambda: rag.query(long, max_new_tokens=4), lambda: rag.answer(long, [FACTS[0][0]])):
        with pytest.raises(ContextOverflowError, match="context"):
            call()
    code, _, err = cli(capsys, "ask", long, "--index", rag.path, "--max-new-tokens", "4")
    assert code == 2 and "context" in err and err.count("\n") == 1


@pytest.mark.parametrize("top_k", [0, -1, 10**9, 2.5, True, "3", None, math.nan])
def test_absurd_top_k(rag, top_k):
    with pytest.raises(InvalidRequestError, match="top_k must be"):
        rag.query(Q, top_k=top_k)


def test_a_top_k_beyond_the_corpus_answers_over_every_chunk(rag):
    answer = rag.query(Q, top_k=10_000, max_new_tokens=2)
    assert len(answer.sources) == len(rag.index) and answer.stats.chunks_encoded == 0


@pytest.mark.parametrize("budget", [0, -0.1, 1.0001, math.nan, math.inf, -math.inf, "0.1", True, 10**9])
def test_absurd_budget(rag, budget):
    with pytest.raises(InvalidRequestError, match="budget must be"):
        rag.query(Q, budget=budget, max_new_tokens=2)


def test_no_budget_is_the_default_budget(rag):
    assert rag.query(Q, budget=None, max_new_tokens=1).stats.budget == 0.05


@pytest.mark.parametrize("max_new_tokens", [0, -5, 10**9])
def test_absurd_max_new_tokens(rag, max_new_tokens):
    with pytest.raises((InvalidRequestError, ContextOverflowError), match="max_new_tokens"):
        rag.query(Q, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--top-k", "0"], "top_k must be"),
        (["--top-k", "999999999"], "top_k must be"),
        (["--top-k", "x"], "invalid int value"),
        (["--budget", "nan"], "budget must be"),
        (["--budget", "1e309"], "budget must be"),
        (["--budget", "-1"], "budget must be"),
        (["--max-new-tokens", "0"], "max_new_tokens must be"),
        (["--max-new-tokens", "999999999"], "context"),
        (["--threads", "-1"], "--threads must be"),
        (["--threads", "0"], "--threads must be"),
        (["--strategy", ""], "unknown strategy"),
    ],
)
def test_absurd_values_on_the_command_line(rag, capsys, argv, phrase):
    code, _, err = cli(capsys, "ask", Q, "--index", rag.path, *argv)
    assert code == 2 and phrase in err and "Traceback" not in err


# -- fuzz: the CLI's arguments --------------------------------------------------------

WORDS = ["ask", "ingest", "info", "--index", "--top-k", "--budget", "--strategy", "--picker", "--json", "--stream",
         "--max-new-tokens", "--bm25", "--chunk-tokens", "--overlap", "--storage-dtype", "--namespace", "--quiet",
         "--threads", "--redis", "INDEX", "MISSING", "DOCS", "-1", "0", "1", "2", "3", "0.5", "nan", "1e400",
         "reuse", "oracle", "int4", "x", "", " ", "--", "-", "redis://", "t:1", "Who runs the harbour?"]  # fmt: skip


@given(argv=st.lists(st.one_of(st.sampled_from(WORDS), st.text(max_size=12)), max_size=9))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_cli_arguments_end_in_an_answer_or_a_one_line_error(rag, tmp_path, capsys, argv):
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    (docs / "a.txt").write_text("The harbour of Velloria holds forty ships.")
    paths = {"INDEX": str(rag.path), "MISSING": str(tmp_path / "missing"), "DOCS": str(docs)}
    argv = [paths.get(a, a) for a in argv]
    threads = torch.get_num_threads()
    try:
        code, _, err = cli(capsys, *argv)
    finally:
        torch.set_num_threads(threads)
    assert code in (0, 2), (argv, err)
    if code == 2:
        assert "Traceback" not in err and (err.startswith("kvrag: error:") or "usage:" in err), (argv, err)
        if err.startswith("kvrag: error:"):
            assert err.count("\n") == 1, err
