"""KVRAGRunnable: the same answers as the engine, through every Runnable entry point, callbacks and LCEL."""

import json

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.runnables import ConfigurableField, RunnableLambda, RunnablePassthrough

from kvrag import NO_CONTEXT, EmptyInputError, InvalidRequestError
from langchain_kvrag import KVRAGRetriever, KVRAGRunnable

Q = "Who runs Velloria's harbour?"
Q2 = "When does the river Tam flood?"
GEN = {"top_k": 3, "max_new_tokens": 8}  # greedy by default
SAID = ("read", "plan", "reason", "abstained")  # what every surface reports beside the text


@pytest.fixture
def runnable(rag):
    return KVRAGRunnable(engine=rag, **GEN)


@pytest.fixture
def chain(rag):
    """Any retriever in front: the dict carries the question beside the retriever's documents."""
    return {"question": RunnablePassthrough(), "documents": KVRAGRetriever(engine=rag, k=3)} | KVRAGRunnable(
        engine=rag, max_new_tokens=8, return_dict=True
    )


class ModelRecorder(BaseCallbackHandler):
    """What a tracer sees of model runs."""

    def __init__(self):
        self.starts, self.tokens, self.ends, self.errors = [], [], [], []

    def on_chat_model_start(self, serialized, messages, *, run_id, parent_run_id=None, **kwargs):
        self.starts.append({"messages": messages, "parent": parent_run_id, **kwargs})

    def on_llm_new_token(self, token, *, chunk=None, **kwargs):
        self.tokens.append((token, chunk))

    def on_llm_end(self, response, **kwargs):
        self.ends.append(response)

    def on_llm_error(self, error, **kwargs):
        self.errors.append(type(error).__name__)


class Recorder(BaseCallbackHandler):
    def __init__(self):
        self.events = []

    def on_chain_start(self, serialized, inputs, *, name=None, **kwargs):
        self.events.append(("start", name, inputs))

    def on_chain_end(self, outputs, **kwargs):
        self.events.append(("end", outputs))

    def on_chain_error(self, error, **kwargs):
        self.events.append(("error", type(error).__name__))


@pytest.mark.parametrize("strategy", ["target_recompute", "reuse", "full_prefill"])
def test_greedy_answer_equals_the_engines(rag, strategy):
    expected = rag.query(Q, strategy=strategy, **GEN).text
    assert expected  # the tiny model says something, so the comparisons below are not of empty strings
    assert KVRAGRunnable(engine=rag, strategy=strategy, **GEN).invoke(Q) == expected
    assert KVRAGRunnable(engine=rag, **GEN).with_config(configurable={"strategy": strategy}).invoke(Q) == expected


def test_dict_output_is_the_answers_json_form(rag):
    expected = rag.query(Q, **GEN)
    out = KVRAGRunnable(engine=rag, return_dict=True, **GEN).invoke(Q)
    assert set(out) == {"answer", "finish_reason", "sources", "stats", *SAID} and json.dumps(out)
    assert out["answer"] == expected.text and out["finish_reason"] == expected.finish_reason
    assert [s["id"] for s in out["sources"]] == [s.id for s in expected.sources]
    assert out["stats"]["store_hits"] == 3 and out["stats"]["chunks_encoded"] == 0
    assert set(out["stats"]) == set(expected.to_dict()["stats"])


def test_stream_yields_the_engines_pieces(rag, runnable):
    *pieces, _final = list(rag.stream(Q, **GEN))
    assert list(runnable.stream(Q)) == pieces and len(pieces) > 1
    chunks = list(KVRAGRunnable(engine=rag, return_dict=True, **GEN).stream(Q))
    assert chunks[:-1] == [{"answer": p} for p in pieces]
    assert set(chunks[-1]) == {"finish_reason", "sources", "stats", *SAID}
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c  # AddableDicts: the chunks add up to invoke's dict
    assert total["answer"] == "".join(pieces) and len(total["sources"]) == 3


def test_batch_answers_each_input_as_invoke_does(runnable, facts):
    docs = [Document(page_content=facts[2][0])]
    inputs = [Q, Q2, {"question": Q2, "documents": docs}]
    assert runnable.batch(inputs) == [runnable.invoke(i) for i in inputs]


async def test_ainvoke_and_astream_match_sync(rag, runnable):
    assert await runnable.ainvoke(Q) == runnable.invoke(Q)
    assert [p async for p in runnable.astream(Q)] == list(runnable.stream(Q))
    assert await runnable.abatch([Q, Q2]) == runnable.batch([Q, Q2])
    as_dict = KVRAGRunnable(engine=rag, return_dict=True, **GEN)
    chunks = [c async for c in as_dict.astream(Q)]
    assert "".join(c.get("answer", "") for c in chunks) == runnable.invoke(Q)
    assert set(chunks[-1]) == {"finish_reason", "sources", "stats", *SAID}


async def test_async_over_given_documents(rag, chain):
    out = await chain.ainvoke(Q2)
    assert out["answer"] == rag.query(Q2, **GEN).text
    chunks = [c async for c in chain.astream(Q2)]
    assert "".join(c["answer"] for c in chunks[:-1]) == out["answer"] and len(chunks) > 2
    assert chunks[-1]["sources"] == out["sources"]


def test_lcel_dict_with_a_retriever_answers_over_its_documents(rag, chain):
    expected = rag.query(Q, **GEN)  # same chunks, order and scores: the same greedy answer
    out = chain.invoke(Q)
    assert out["answer"] == expected.text
    assert [s["id"] for s in out["sources"]] == [s.id for s in expected.sources]
    assert out["stats"]["store_hits"] == 3 and out["stats"]["chunks_encoded"] == 0
    streamed = list(chain.stream(Q))  # over the retriever's documents, piece by piece
    pieces = [c["answer"] for c in streamed[:-1]]
    assert len(pieces) > 1 and "".join(pieces) == expected.text
    assert set(streamed[-1]) == {"finish_reason", "sources", "stats", *SAID}
    texts = chain | RunnableLambda(lambda d: d["answer"].upper())
    assert texts.invoke(Q) == expected.text.upper()


def test_scores_come_from_document_metadata(rag):
    runnable = KVRAGRunnable(engine=rag, max_new_tokens=2, return_dict=True)
    first, second = rag.retrieve(Q, top_k=2)
    ranked = [
        Document(page_content=first.text, metadata={"score": 0.1}),
        Document(page_content=second.text, metadata={"score": 0.9}),
    ]
    out = runnable.invoke({"question": Q, "documents": ranked})
    assert out["stats"]["target"] == 1 and [s["score"] for s in out["sources"]] == [0.1, 0.9]
    unscored = [Document(page_content=first.text), Document(page_content=second.text, metadata={"score": 0.9})]
    assert runnable.invoke({"question": Q, "documents": unscored})["stats"]["target"] == 0  # best-first list


def test_text_from_another_retriever_is_encoded_once(rag, facts):
    runnable = KVRAGRunnable(engine=rag, max_new_tokens=2, return_dict=True)
    foreign = {
        "question": "Where is the tower of Quell?",
        "documents": [Document(page_content="The tower of Quell stands on the northern cliff."), facts[4][0]],
    }
    first = runnable.invoke(foreign)
    assert first["stats"]["chunks_encoded"] == 1 and first["stats"]["store_hits"] == 1
    assert first["sources"][0]["id"] == "given#0"
    assert runnable.invoke(foreign)["stats"]["chunks_encoded"] == 0  # its KV is stored now


def test_configurable_strategy_budget_and_top_k(rag, runnable):
    assert {s.id for s in runnable.config_specs} == {"strategy", "budget", "top_k"}
    as_dict = KVRAGRunnable(engine=rag, return_dict=True, **GEN)
    out = as_dict.with_config(configurable={"strategy": "reuse", "budget": 0.2, "top_k": 2}).invoke(Q)
    assert out["stats"]["strategy"] == "reuse" and out["stats"]["budget"] == 0.2 and len(out["sources"]) == 2
    assert as_dict.invoke(Q)["stats"]["strategy"] == "target_recompute"
    # through a chain, and beside LangChain's own configurable_fields idiom (equal specs, no conflict)
    chain = RunnablePassthrough() | as_dict.configurable_fields(
        strategy=ConfigurableField(id="strategy"), budget=ConfigurableField(id="budget")
    )
    assert {s.id for s in chain.config_specs} == {"strategy", "budget", "top_k"}
    out = chain.invoke(Q, config={"configurable": {"strategy": "spread", "top_k": 1}})
    assert out["stats"]["strategy"] == "spread" and len(out["sources"]) == 1
    with pytest.raises(InvalidRequestError, match="strategy"):
        runnable.invoke(Q, config={"configurable": {"strategy": "no_such_strategy"}})


def test_callbacks_fire_for_invoke_stream_and_errors(runnable):
    recorder = Recorder()
    text = runnable.invoke(Q, config={"callbacks": [recorder], "run_name": "kv"})
    assert recorder.events == [("start", "kv", Q), ("end", text)]
    recorder.events.clear()
    pieces = list(runnable.stream(Q, config={"callbacks": [recorder]}))
    assert [e[0] for e in recorder.events] == ["start", "end"] and recorder.events[0][1] == "KVRAGRunnable"
    assert recorder.events[1][1] == "".join(pieces)
    recorder.events.clear()
    with pytest.raises(EmptyInputError):
        runnable.invoke("   ", config={"callbacks": [recorder]})
    assert recorder.events[-1] == ("error", "EmptyInputError")


def test_callbacks_in_a_chain_see_the_runnable(chain):
    recorder = Recorder()
    out = chain.invoke(Q, config={"callbacks": [recorder]})
    ours = [e for e in recorder.events if e[0] == "start" and e[1] == "KVRAGRunnable"]
    assert len(ours) == 1 and ours[0][2]["question"] == Q and len(ours[0][2]["documents"]) == 3
    assert recorder.events[-1] == ("end", out)


async def test_astream_events(runnable):
    events = [e async for e in runnable.astream_events(Q, version="v2")]
    ours = [e["event"] for e in events if e["name"] == "KVRAGRunnable"]
    assert ours[0] == "on_chain_start" and ours[-1] == "on_chain_end" and "on_chain_stream" in ours
    streamed = "".join(e["data"]["chunk"] for e in events if e["event"] == "on_chain_stream")
    assert streamed == events[-1]["data"]["output"] == runnable.invoke(Q)


def test_nothing_retrieved_answers_no_context_in_every_mode_without_generating(rag):
    """The same for both adapters: filters that match nothing, or an empty document list, answer NO_CONTEXT."""
    chain = {
        "question": RunnablePassthrough(),
        "documents": KVRAGRetriever(engine=rag, filters={"topic": "none"}),
    } | KVRAGRunnable(engine=rag, max_new_tokens=2)
    own = KVRAGRunnable(engine=rag, filters={"topic": "none"}, max_new_tokens=2)
    for runnable in (chain, own):
        recorder = ModelRecorder()
        assert runnable.invoke(Q, config={"callbacks": [recorder]}) == NO_CONTEXT
        assert "".join(runnable.stream(Q)) == NO_CONTEXT
        assert recorder.starts == []  # nothing generated: no model run
    as_dict = KVRAGRunnable(engine=rag, filters={"topic": "none"}, return_dict=True)
    out = as_dict.invoke(Q)
    assert out["answer"] == NO_CONTEXT and out["finish_reason"] == "no_context" and out["sources"] == []
    assert out["stats"]["new_tokens"] == 0 and out["stats"]["strategy"] == "none"
    total = None
    for chunk in as_dict.stream(Q):
        total = chunk if total is None else total + chunk
    assert total == out | {"stats": total["stats"]} and total["finish_reason"] == "no_context"
    assert KVRAGRunnable(engine=rag).invoke({"question": Q, "documents": []}) == NO_CONTEXT


async def test_nothing_retrieved_answers_no_context_async(rag):
    own = KVRAGRunnable(engine=rag, filters={"topic": "none"}, max_new_tokens=2)
    assert await own.ainvoke(Q) == NO_CONTEXT
    assert "".join([p async for p in own.astream(Q)]) == NO_CONTEXT
    assert await KVRAGRunnable(engine=rag).ainvoke({"question": Q, "context": []}) == NO_CONTEXT


def test_a_bare_document_list_is_refused_with_the_fix(rag):
    bare = KVRAGRetriever(engine=rag, k=2) | KVRAGRunnable(engine=rag, max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="a list of Documents.*RunnablePassthrough"):
        bare.invoke(Q)
    with pytest.raises(InvalidRequestError, match="documents\\[0\\] is a int"):
        KVRAGRunnable(engine=rag).invoke({"question": Q, "documents": [3]})


def test_the_output_and_callbacks_tell_the_chunks_read_and_the_plan_as_the_engine_does(rag):
    runnable = KVRAGRunnable(engine=rag, strategy="target_only", return_dict=True, **GEN)
    recorder = ModelRecorder()
    out = runnable.invoke(Q, config={"callbacks": [recorder]})
    core = rag.query(Q, strategy="target_only", **GEN)
    assert out["read"] == [s.id for s in core.read] and len(out["read"]) == 1
    assert [s["read"] for s in out["sources"]] == [s.read for s in core.sources]
    assert out["plan"] == "target_only" and out["reason"] == core.stats.reason and out["abstained"] is False
    metadata = recorder.ends[-1].generations[0][0].message.response_metadata
    assert {k: metadata[k] for k in SAID} == {k: out[k] for k in SAID}
