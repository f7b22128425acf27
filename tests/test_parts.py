"""A question a part at a time: the splitter, the caller's parts, hops, and each part equal to itself asked alone."""

import pytest
from tiny import FACTS, STRATEGY_CHUNKS, byte_tokenizer, tiny_model

from kvrag import InvalidRequestError, KVModel
from kvrag.plan.parts import Part, compose, parts_of, resolve_parts, split


@pytest.mark.parametrize(
    "question, parts",
    [
        (
            "What is the founding year of Velloria, and who is the founder of Dorwick?",
            ["What is the founding year of Velloria?", "Who is the founder of Dorwick?"],
        ),
        (
            "What is the birth year of each of Liora Pellwyn, Petra Vorith and Lucan Vorley?",
            ["What is the birth year of Liora Pellwyn?", "What is the birth year of Petra Vorith?",
             "What is the birth year of Lucan Vorley?"],
        ),
        (
            "what are the main products of both Kasith Works and Dorwick Mills",
            ["What are the main products of Kasith Works?", "What are the main products of Dorwick Mills?"],
        ),
        ("Which was founded earlier, Wynton or Quenmouth?", None),  # a comparison is answered whole
        ("What is the best-known book of the founder of Kasith Works?", None),  # a hop needs the caller's parts
        ("How do I read and write files?", None),  # "and" inside one question
        ("What is the mayor of each of Velloria?", None),  # one thing: nothing to split
    ],
)
def test_the_splitter_takes_the_common_forms_and_leaves_the_rest_whole(question, parts):
    got = split(question)
    assert (None if got is None else [p.question for p in got]) == parts


def test_callers_parts_hops_and_their_errors():
    parts = parts_of(["Who founded Velloria?", "What is the birth year of {answer}?"])
    assert [p.hop for p in parts] == [False, True]
    assert parts[1].asked("Marten Velek.") == "What is the birth year of Marten Velek?"
    assert resolve_parts("Who is it?", None) is None and resolve_parts("Who is it?", "auto") is None
    for bad, message in (
        ([], "non-empty list"),
        ("all", 'give "auto" or a list'),
        (["What is {answer}?"], "no part comes before it"),
        (["Who?", ""], "part 1 is ''"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            resolve_parts("q", bad)
    assert compose([Part("a?"), Part("b?")], [" 1873. ", "Elsa\nMorrow"]) == "1873.\nElsa Morrow"


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


def test_each_part_is_answered_as_if_asked_alone_over_chunk_kv_read_once(kv):
    questions = ["When does the archive open?", "What do cats hunt?"]
    whole = "When does the archive open, and what do cats hunt?"
    got = kv.answer(whole, STRATEGY_CHUNKS, parts="auto", strategy="target_recompute", max_new_tokens=6)
    assert [p.question for p in split(whole)] == questions and len(got.parts) == 2
    for part, question in zip(got.parts, questions):
        alone = kv.answer(question, STRATEGY_CHUNKS, strategy="target_recompute", picker="likelihood", max_new_tokens=6)
        assert part.token_ids == alone.token_ids and part.stats.target == alone.stats.target
        assert part.stats.picker == "likelihood"  # no scores: each part picks by its own likelihood
    assert got.text == "\n".join(" ".join(p.text.split()) for p in got.parts)
    assert got.token_ids == got.parts[0].token_ids + got.parts[1].token_ids
    assert got.stats.new_tokens == sum(p.stats.new_tokens for p in got.parts)
    # the chunks were encoded once for both parts (the count is the shared chunks', not one a part)
    assert got.parts[0].stats.chunks_encoded == got.parts[1].stats.chunks_encoded <= len(STRATEGY_CHUNKS)
    assert got.stats.total_s >= got.parts[0].stats.total_s and got.stats.ttft_s <= got.stats.total_s
    assert "parts" in got.to_dict() and len(got.to_dict()["parts"]) == 2
    # a question the splitter cannot split is answered whole, as without parts
    plain = kv.answer("When does the archive open?", STRATEGY_CHUNKS, parts="auto", max_new_tokens=4)
    assert plain.parts == [] and plain.token_ids == kv.answer("When does the archive open?", STRATEGY_CHUNKS,
                                                              max_new_tokens=4).token_ids


def test_the_engine_scores_each_part_against_the_retrieved_chunks(kv):
    from tiny import HashEmbedder

    from kvrag import KVRAG
    from kvrag.cache.store import MemoryStore
    from kvrag.engine.documents import Document

    rag = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore())
    rag.ingest([Document(text, meta) for text, meta in FACTS], split=False, progress=False)
    question = "Who built the lighthouse of Karsa, and who runs Velloria's harbour?"
    got = rag.query(question, parts="auto", top_k=4, strategy="target_recompute", max_new_tokens=4)
    picked = [p.sources[p.stats.target].text for p in got.parts]
    assert "lighthouse of Karsa" in picked[0] and "harbour" in picked[1]  # each part its own target
    assert [s.text for s in got.sources] == [s.text for s in got.parts[0].sources]  # retrieved once
    assert got.stats.retrieve_s > 0


def test_a_default_that_splits_is_applied_when_no_strategy_is_named(kv, monkeypatch):
    from kvrag.plan import defaults

    split_default = {"strategy": "target_recompute", "picker": None, "budget": 0.05, "parts": "auto"}
    monkeypatch.setitem(defaults.SHIPPED, kv.fingerprint.weights, split_default)
    whole = "When does the archive open, and what do cats hunt?"
    got = kv.answer(whole, STRATEGY_CHUNKS, max_new_tokens=3)
    assert len(got.parts) == 2 and got.stats.strategy == "target_recompute"
    named = kv.answer(whole, STRATEGY_CHUNKS, strategy="target_recompute", max_new_tokens=3)
    assert named.parts == []  # a strategy named by the caller answers whole unless parts= says otherwise
