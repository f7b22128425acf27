"""Hostile values through the engine's public API: every call answers, or raises a `KVRAGError`.

Wrong types (ints, huge ints, floats with nan and inf, None, bools, bytes, sets, lists, dicts), empty strings
and lone surrogates go into every argument of `ingest`, `delete`, `retrieve`, `query`, `stream` and `answer`.
Any exception that is not a kvrag error (a TypeError from deep inside, a faiss or torch error) fails the test
with the input shown. Runs derandomized: the same examples every run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny import FACTS, HashEmbedder, byte_tokenizer, tiny_model

from kvrag import Document, KVModel
from kvrag.answer import Answer, Source
from kvrag.cache.store import MemoryStore
from kvrag.engine.rag import KVRAG, IngestStats
from kvrag.errors import KVRAGError
from kvrag.plan.pickers import PICKERS
from kvrag.plan.strategies import STRATEGIES

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# examples a test: 5,000 in all
INGEST, DELETE, RETRIEVE, QUERY, ANSWER = 1100, 400, 1000, 1500, 1000

QUESTIONS = ["Who runs Velloria's harbour?", "When was the lighthouse of Karsa built?", "What does the mill grind?"]


def engine() -> KVRAG:
    return KVRAG(KVModel(tiny_model("llama"), byte_tokenizer()), embedder=HashEmbedder(), store=MemoryStore())


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls gain nothing from threads, and thousands of small runs on a busy machine's
    threads each wait for a core: one thread keeps the file's time steady. Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rag() -> KVRAG:
    """The engine that is queried: its index holds FACTS only, never changed by the tests."""
    rag = engine()
    rag.ingest(FACTS, progress=False)
    return rag


@pytest.fixture(scope="module")
def scratch() -> KVRAG:
    """The engine that is ingested into and deleted from."""
    rag = engine()
    rag.ingest(FACTS, progress=False)
    return rag


def outcome(call: Callable[[], Any]) -> Any:
    """What `call` returns, or the KVRAGError it raised; any other exception fails the example."""
    try:
        result = call()
    except KVRAGError as err:
        assert str(err), f"{type(err).__name__} without a message"
        event(type(err).__name__)
        return err
    except Exception as err:  # the property: nothing but a kvrag error leaves the API
        raise AssertionError(f"{type(err).__name__} leaked from the API: {err}") from err
    event("answered")
    return result


# -- hostile values ----------------------------------------------------------------------------------------

ODD_TEXT = st.sampled_from(["", " ", "\n\t", "\ud800", "a\udcffb", "\x00", "é", "\U0001f600", "x" * 300])
SCALAR = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2**63, 2**64, -(2**63) - 1, 10**400]),
    st.floats(),  # nan and inf included
    st.none(),
    st.booleans(),
    st.binary(max_size=8),
    st.text(max_size=8),
    ODD_TEXT,
)
HOSTILE = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.tuples(inner, inner),
        st.frozensets(st.one_of(st.integers(), st.text(max_size=3)), max_size=3),
        st.sets(st.one_of(st.integers(), st.text(max_size=3)), max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=3), st.integers()), inner, max_size=3),
    ),
    max_leaves=6,
)


def rarely(bad: st.SearchStrategy[Any], valid: st.SearchStrategy[Any], percent: int = 25) -> st.SearchStrategy[Any]:
    """`bad` in about `percent` % of the draws, else `valid`."""
    return st.integers(0, 99).flatmap(lambda n: bad if n < percent else valid)


def maybe(valid: st.SearchStrategy[Any], percent: int = 25) -> st.SearchStrategy[Any]:
    """A hostile value in about `percent` % of the draws, else a valid one."""
    return rarely(HOSTILE, valid, percent)


# -- ingest and delete ---------------------------------------------------------------------------------------

META_KEY = rarely(
    st.one_of(ODD_TEXT, st.integers(), st.just((1, 2)), st.none(), st.booleans(), st.floats()),
    st.sampled_from(["topic", "lang", "year", "source", "tags"]),
)
META_VALUE = maybe(
    st.one_of(
        st.text(max_size=6),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(),
        st.none(),
        st.lists(st.integers(), max_size=3),
        st.tuples(st.text(max_size=3), st.integers()),
    )
)
METADATA = maybe(st.one_of(st.none(), st.dictionaries(META_KEY, META_VALUE, max_size=3)))
TEXT = rarely(ODD_TEXT, st.one_of(st.text(min_size=1, max_size=40), st.sampled_from([f[0] for f in FACTS])))
ITEM = maybe(
    st.one_of(
        TEXT,
        st.tuples(TEXT, METADATA),
        st.builds(Document, text=maybe(TEXT, 10), metadata=METADATA, id=maybe(st.sampled_from(["", "doc-a"]), 10)),
        st.just(Path("/nonexistent/kvrag-fuzz.txt")),
    ),
    10,
)
ITEMS = maybe(
    st.one_of(
        ITEM,
        st.lists(ITEM, max_size=3),
        st.lists(ITEM, max_size=3).map(tuple),
        st.sets(st.text(min_size=1, max_size=8), max_size=3),
    ),
    15,
)


@given(items=ITEMS, metadata=METADATA)
@settings(FUZZ, max_examples=INGEST)
def test_fuzz_ingest(scratch, items, metadata):
    before = len(scratch.index)
    result = outcome(lambda: scratch.ingest(items, metadata=metadata, progress=False))
    if isinstance(result, KVRAGError):
        assert len(scratch.index) == before  # refused whole: nothing half-ingested
        return
    assert isinstance(result, IngestStats) and result.documents >= 1
    for record in scratch.index.records.values():  # metadata comes back as it went in: JSON, str keys
        assert json.loads(json.dumps(record.metadata, allow_nan=False)) == record.metadata


@given(doc_id=maybe(st.sampled_from(["", "nope", "text-0", "x#0", "doc-a"]), 75))
@settings(FUZZ, max_examples=DELETE)
def test_fuzz_delete(scratch, doc_id):
    result = outcome(lambda: scratch.delete(doc_id))
    assert isinstance(result, (int, KVRAGError)) and not isinstance(result, bool)


# -- retrieve, query, stream, answer ------------------------------------------------------------------------

QUESTION = maybe(rarely(st.one_of(st.text(max_size=30), ODD_TEXT), st.sampled_from(QUESTIONS)), 15)
FILTERS = st.sampled_from(
    [None, {}, {"topic": "buildings"}, {"lang": ["en", "fr"]}, {"topic": "nope"}, {"year": (1872, 1901)}]
)
RETRIEVAL = {"top_k": st.integers(1, 6), "filters": FILTERS, "bm25": st.booleans()}
OPTIONS = {
    "strategy": st.sampled_from(sorted(STRATEGIES)),
    "picker": st.sampled_from(sorted(PICKERS)),
    "budget": st.floats(0.01, 1.0),
    "strict": st.booleans(),
    "target": st.integers(0, 4),
    "temperature": st.sampled_from([0.0, 0.7, 1]),
    "top_p": st.sampled_from([0.5, 0.9, 1.0]),
    "seed": st.integers(0, 9),
    "stop": st.sampled_from(["x", ".", ["\n", "the"], ()]),
}
# a hostile max_new_tokens, but not a valid count above 3 (a run decoding hundreds of tokens tests nothing more)
FEW_TOKENS = HOSTILE.filter(lambda v: not (type(v) is int and 3 < v < 10**5))
UNKNOWN = ["top-k", "temp", "Strategy"]  # misspelt option names: keyword arguments a request refuses


@st.composite
def kwargs(draw: Any, *groups: dict[str, st.SearchStrategy[Any]]) -> dict[str, Any]:
    """Valid options (each given or not), then none, one or two of them (or a misspelt name) given a hostile
    value. max_new_tokens is always given (valid: 1..3), so a request that runs decodes a few tokens only."""
    valid = {k: v for g in groups for k, v in g.items()}
    kw = draw(st.fixed_dictionaries({"max_new_tokens": st.integers(1, 3)}, optional=valid))
    names = sorted(valid) + ["max_new_tokens"] + (UNKNOWN if "strategy" in valid else [])
    for name in draw(rarely(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True), st.just([]), 45)):
        kw[name] = draw(FEW_TOKENS if name == "max_new_tokens" else HOSTILE)
    return kw


def check_answer(result: Any, kw: dict[str, Any]) -> None:
    if isinstance(result, KVRAGError):
        return
    assert isinstance(result, Answer), f"got a {type(result).__name__}"
    assert result.stats.new_tokens <= kw["max_new_tokens"]


@given(question=QUESTION, kw=kwargs(RETRIEVAL))
@settings(FUZZ, max_examples=RETRIEVE)
def test_fuzz_retrieve(rag, question, kw):
    result = outcome(lambda: rag.retrieve(question, **{k: v for k, v in kw.items() if k != "max_new_tokens"}))
    if not isinstance(result, KVRAGError):
        assert isinstance(result, list) and all(isinstance(s, Source) for s in result)
        assert len(result) <= kw.get("top_k", 5)


@given(question=QUESTION, kw=kwargs(RETRIEVAL, OPTIONS), streamed=st.booleans())
@settings(FUZZ, max_examples=QUERY)
def test_fuzz_query_and_stream(rag, question, kw, streamed):
    if streamed:
        result = outcome(lambda: list(rag.stream(question, **kw)))
        if isinstance(result, list):
            assert all(isinstance(piece, str) for piece in result[:-1])
            result = result[-1]
    else:
        result = outcome(lambda: rag.query(question, **kw))
    check_answer(result, kw)


FACT_TEXTS = [f[0] for f in FACTS]
CHUNK = maybe(rarely(st.one_of(st.text(min_size=1, max_size=30), ODD_TEXT), st.sampled_from(FACT_TEXTS)), 10)
CHUNKS = maybe(
    rarely(
        st.just([]),
        st.one_of(
            st.lists(CHUNK, min_size=1, max_size=4),
            st.lists(st.sampled_from(FACT_TEXTS), min_size=1, max_size=4).map(tuple),
            st.lists(
                st.builds(Source, id=st.text(max_size=4), text=CHUNK, score=maybe(st.floats(-1, 1))),
                min_size=1,
                max_size=3,
            ),
        ),
        5,
    ),
    15,
)
BAD_SCORES = st.one_of(
    st.lists(SCALAR, max_size=4),
    st.sampled_from(["xx", "0.5", b"1", 5, 0.5, {0.1, 0.2}, {"a": 1.0}, [math.nan], [10**400]]),
    HOSTILE,
)


def scores_for(chunks: Any) -> st.SearchStrategy[Any]:
    """None, one score a chunk, or (a quarter of the time) bad scores."""
    n = len(chunks) if isinstance(chunks, (list, tuple)) else 1
    return rarely(BAD_SCORES, st.one_of(st.none(), st.lists(st.floats(-1, 1), min_size=n, max_size=n)))


@given(
    question=QUESTION,
    chunks_and_scores=CHUNKS.flatmap(lambda c: st.tuples(st.just(c), scores_for(c))),
    kw=kwargs(OPTIONS),
)
@settings(FUZZ, max_examples=ANSWER)
def test_fuzz_answer(rag, question, chunks_and_scores, kw):
    chunks, scores = chunks_and_scores
    check_answer(outcome(lambda: rag.answer(question, chunks, scores=scores, **kw)), kw)


def test_the_fuzz_runs_5000_examples():
    assert INGEST + DELETE + RETRIEVE + QUERY + ANSWER >= 5000


# -- every numeric argument at its edges ----------------------------------------------------------------------------

# The numbers at and past each argument's edges: zeros of both signs, the smallest subnormal and a temperature that
# underflows (1e-40: logits divided by it were inf, the softmax nan, and torch raised a raw RuntimeError), the
# greedy threshold, huge, nan and inf, ints past int64, and a bool.
EDGES = [0, -0.0, 0.0, 5e-324, 1e-40, -1e-40, 1e-6, 1e-5, 0.5, 1, 1.0000001, 2, 1e6, 1e7, 1e308, -1, -1e308,
         math.nan, math.inf, -math.inf, 2**63, -(2**63) - 1, 10**400, True]
NUMERIC = ["temperature", "top_p", "seed", "max_new_tokens", "prompt_lookup", "top_k", "budget", "target"]
EDGE_CALLS = 400


@given(
    question=st.sampled_from(QUESTIONS),
    edges=st.dictionaries(st.sampled_from(NUMERIC), st.sampled_from(EDGES), min_size=1, max_size=3),
    call=st.sampled_from(["query", "stream", "answer"]),
)
@settings(FUZZ, max_examples=EDGE_CALLS)
def test_fuzz_every_numeric_argument_at_its_edges(rag, question, edges, call):
    kw = {"max_new_tokens": 2, "strategy": "reuse", **edges}
    if isinstance(kw["max_new_tokens"], (int, float)) and not isinstance(kw["max_new_tokens"], bool):
        if kw["max_new_tokens"] > 3 and kw["max_new_tokens"] < 10**5:
            kw["max_new_tokens"] = 3  # a valid count decodes a few tokens only
    if call == "answer":
        kw.pop("top_k", None)
        result = outcome(lambda: rag.answer(question, FACT_TEXTS[:2], **kw))
    elif call == "stream":
        result = outcome(lambda: list(rag.stream(question, **kw)))
        result = result[-1] if isinstance(result, list) else result
    else:
        result = outcome(lambda: rag.query(question, **kw))
    check_answer(result, kw)


def test_a_temperature_that_underflows_is_greedy(rag):
    greedy = rag.query(QUESTIONS[0], max_new_tokens=4, strategy="reuse")
    for temperature in (1e-40, 5e-324, 1e-6):  # before: RuntimeError "probability tensor contains inf, nan"
        for call in (rag.query, lambda q, **kw: list(rag.stream(q, **kw))[-1]):
            tiny = call(QUESTIONS[0], max_new_tokens=4, strategy="reuse", temperature=temperature, seed=1)
            assert tiny.token_ids == greedy.token_ids
        answered = rag.answer(QUESTIONS[0], FACT_TEXTS[:2], max_new_tokens=4, temperature=temperature)
        assert answered.token_ids == rag.answer(QUESTIONS[0], FACT_TEXTS[:2], max_new_tokens=4).token_ids
