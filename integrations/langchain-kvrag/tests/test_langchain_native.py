"""What a LangChain user expects of the runnable: its generation as a model run, its arguments checked when it
is built, the framework's input vocabulary, and serialization."""

import pickle

import pytest
from langchain_core.callbacks import get_usage_metadata_callback
from langchain_core.documents import Document
from langchain_core.load import dumpd, dumps, load, loads
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from test_langchain_runnable import ModelRecorder

from kvrag import KVRAG, InvalidRequestError, MemoryStore
from langchain_kvrag import ChatKVRAG, KVRAGRetriever, KVRAGRunnable

Q = "Who runs Velloria's harbour?"
GEN = {"top_k": 3, "max_new_tokens": 8}


# -- the generation as a chat model run -----------------------------------------------------------------


def test_the_generation_is_a_child_chat_model_run_with_tokens_and_usage(rag):
    runnable = KVRAGRunnable(engine=rag, return_dict=True, **GEN)
    recorder = ModelRecorder()
    out = runnable.invoke(Q, config={"callbacks": [recorder]})
    (start,) = recorder.starts
    system, human = start["messages"][0]
    assert human.content == Q and system.content == "\n\n".join(s["text"] for s in out["sources"])
    assert start["parent"] is not None and start["name"] == "kvrag"
    assert start["invocation_params"]["max_new_tokens"] == 8
    assert start["metadata"]["ls_provider"] == "kvrag" and start["metadata"]["ls_model_type"] == "chat"
    assert "".join(t for t, _ in recorder.tokens) == out["answer"] and len(recorder.tokens) > 1
    assert all(chunk.message.content == t for t, chunk in recorder.tokens)
    (end,) = recorder.ends
    message = end.generations[0][0].message
    assert message.content == out["answer"]
    assert message.usage_metadata["input_tokens"] == out["stats"]["prompt_tokens"]
    assert message.usage_metadata["output_tokens"] == out["stats"]["new_tokens"]
    assert message.response_metadata["kvrag"]["order"] == out["stats"]["order"]


def test_token_counters_and_streams_see_the_model_run(rag):
    runnable = KVRAGRunnable(engine=rag, return_dict=True, **GEN)
    with get_usage_metadata_callback() as usage:
        out = runnable.invoke(Q)
    (counted,) = usage.usage_metadata.values()
    assert counted["input_tokens"] == out["stats"]["prompt_tokens"]
    assert counted["output_tokens"] == out["stats"]["new_tokens"]
    recorder = ModelRecorder()
    pieces = list(KVRAGRunnable(engine=rag, **GEN).stream(Q, config={"callbacks": [recorder]}))
    assert [t for t, _ in recorder.tokens] == [p for p in pieces if p] and len(recorder.ends) == 1


def test_a_failed_generation_is_reported_as_a_model_error(rag):
    recorder = ModelRecorder()
    long = [Document(page_content="tide " * 400)] * 3  # past the tiny model's context once stitched
    with pytest.raises(Exception):
        KVRAGRunnable(engine=rag, max_new_tokens=4).invoke(
            {"question": Q, "documents": long}, {"callbacks": [recorder]}
        )
    assert recorder.errors in ([], ["ContextOverflowError"])  # refused before or during the model run
    assert len(recorder.starts) == len(recorder.errors)


async def test_astream_events_show_a_chat_model_stream(rag):
    runnable = KVRAGRunnable(engine=rag, **GEN)
    events = [e async for e in runnable.astream_events(Q, version="v2")]
    kinds = [e["event"] for e in events]
    assert "on_chat_model_start" in kinds and "on_chat_model_end" in kinds
    streamed = "".join(e["data"]["chunk"].content for e in events if e["event"] == "on_chat_model_stream")
    assert streamed == runnable.invoke(Q)
    (end,) = [e for e in events if e["event"] == "on_chat_model_end"]
    assert end["data"]["output"].usage_metadata["output_tokens"] > 0


# -- arguments checked when the runnable is built ------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"generation_kwargs": {"temprature": 0.5}}, "temprature.*takes temperature"),
        ({"budget": 5}, "budget must be"),
        ({"strategy": "no_such_strategy"}, "strategy"),
        ({"top_k": 0}, "top_k must be"),
        ({"filters": "x"}, "filters is a str"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"similarity_top_k": 3}, "unknown argument.*similarity_top_k.*takes engine"),
    ],
)
def test_bad_arguments_fail_when_the_runnable_is_built(rag, kwargs, phrase):
    with pytest.raises(InvalidRequestError, match=phrase):
        KVRAGRunnable(engine=rag, **kwargs)


def test_a_model_where_an_engine_is_wanted_is_refused_with_the_fix(rag):
    with pytest.raises(InvalidRequestError, match="ChatKVRAG"):
        KVRAGRunnable(engine=rag.kvmodel)
    with pytest.raises(InvalidRequestError, match="engine= .* or index="):
        KVRAGRunnable()


# -- the framework's input vocabulary ---------------------------------------------------------------------


def test_context_is_accepted_as_the_documents(rag):
    docs = [Document(page_content=s.text) for s in rag.retrieve(Q, top_k=3)]
    runnable = KVRAGRunnable(engine=rag, max_new_tokens=8)
    assert runnable.invoke({"question": Q, "context": docs}) == runnable.invoke({"question": Q, "documents": docs})


@pytest.mark.parametrize(
    "value, phrase",
    [
        ({"question": Q, "documents": "some text"}, "documents is a str: pass a list"),
        ({"question": Q, "context": Document(page_content="x")}, "context is a Document: pass a list"),
        ({"question": Q, "docs": []}, "unknown input key.*docs"),
        ({"question": Q, "documents": [], "context": []}, "both 'documents' and 'context'"),
    ],
)
def test_inputs_it_cannot_read_are_refused_never_dropped(rag, value, phrase):
    with pytest.raises(InvalidRequestError, match=phrase):
        KVRAGRunnable(engine=rag).invoke(value)


def test_a_chat_prompt_is_sent_to_the_chat_model(rag):
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    with pytest.raises(InvalidRequestError, match="ChatPromptValue.*ChatKVRAG"):
        (prompt | KVRAGRunnable(engine=rag)).invoke({"question": Q})
    chain = prompt | ChatKVRAG(engine=rag, max_tokens=4) | StrOutputParser()
    assert chain.invoke({"question": Q}) == ChatKVRAG(engine=rag, max_tokens=4).invoke(Q).content


def test_a_configured_top_k_caps_the_documents_a_chain_passes(rag):
    docs = [Document(page_content=s.text) for s in rag.retrieve(Q, top_k=3)]
    runnable = KVRAGRunnable(engine=rag, max_new_tokens=2, return_dict=True)
    assert len(runnable.invoke({"question": Q, "documents": docs})["sources"]) == 3  # top_k unset: all of them
    one = runnable.with_config(configurable={"top_k": 1}).invoke({"question": Q, "documents": docs})
    assert [s["text"] for s in one["sources"]] == [docs[0].page_content]
    two = KVRAGRunnable(engine=rag, top_k=2, max_new_tokens=2, return_dict=True)
    assert len(two.invoke({"question": Q, "documents": docs})["sources"]) == 2


# -- serialization ----------------------------------------------------------------------------------


def test_dumps_records_the_configuration_and_loads_reopens_the_engine(rag):
    runnable = KVRAGRunnable(engine=rag, strategy="reuse", **GEN)
    assert rag.path is not None  # the fixture's engine has a folder
    serialized = dumpd(runnable)
    assert serialized["id"] == ["langchain_kvrag", "runnables", "KVRAGRunnable"]
    assert serialized["kwargs"] == {"index": str(rag.path), "strategy": "reuse", **GEN}
    loaded = loads(dumps(runnable), valid_namespaces=["langchain_kvrag"], allowed_objects=[KVRAGRunnable])
    assert loaded.engine is not rag and loaded.invoke(Q) == runnable.invoke(Q)
    again = pickle.loads(pickle.dumps(runnable))
    assert again.engine is not rag and again.strategy == "reuse" and again.invoke(Q) == runnable.invoke(Q)
    assert load(serialized, valid_namespaces=["langchain_kvrag"], allowed_objects=[KVRAGRunnable]).top_k == 3


def test_an_engine_without_a_folder_says_how_to_serialize(rag):
    memory = KVRAG(rag.kvmodel, embedder=rag.embedder, store=MemoryStore())
    runnable = KVRAGRunnable(engine=memory)
    assert dumpd(runnable)["type"] == "not_implemented"
    with pytest.raises(TypeError, match="KVRAG.from_defaults\\(path\\)"):
        pickle.dumps(runnable)


def test_the_retriever_dumps_loads_and_pickles_as_the_runnable_does(rag):
    retriever = KVRAGRetriever(engine=rag, k=2, filters={"topic": "ports"})
    serialized = dumpd(retriever)
    assert serialized["id"] == ["langchain_kvrag", "retrievers", "KVRAGRetriever"]
    assert serialized["kwargs"] == {"index": str(rag.path), "k": 2, "filters": {"topic": "ports"}}
    loaded = loads(dumps(retriever), valid_namespaces=["langchain_kvrag"], allowed_objects=[KVRAGRetriever])
    assert loaded.engine is not rag and loaded.invoke(Q) == retriever.invoke(Q)
    again = pickle.loads(pickle.dumps(KVRAGRetriever(engine=rag, k=2)))
    assert again.engine is not rag and [d.page_content for d in again.invoke(Q)] == [
        d.page_content for d in KVRAGRetriever(engine=rag, k=2).invoke(Q)
    ]
    memory = KVRAGRetriever(engine=KVRAG(rag.kvmodel, embedder=rag.embedder, store=MemoryStore()))
    assert dumpd(memory)["type"] == "not_implemented"
    with pytest.raises(TypeError, match="KVRAG.from_defaults\\(path\\)"):
        pickle.dumps(memory)


def test_a_retriever_chain_with_a_chat_prompt_reads_like_the_langchain_docs(rag):
    """The README's LCEL chain: documents from kvrag's retriever, then kvrag answers over their stored KV."""
    retriever = KVRAGRetriever(engine=rag, k=3)
    chain = {"question": RunnablePassthrough(), "context": retriever} | KVRAGRunnable(engine=rag, max_new_tokens=8)
    assert chain.invoke(Q) == rag.query(Q, **GEN).text


def test_a_stream_closed_early_ends_its_model_run(rag):
    recorder = ModelRecorder()
    stream = KVRAGRunnable(engine=rag, **GEN).stream(Q, config={"callbacks": [recorder]})
    next(stream)
    stream.close()
    assert len(recorder.starts) == 1 and recorder.ends == [] and recorder.errors == ["GeneratorExit"]
    recorder = ModelRecorder()
    list(KVRAGRunnable(engine=rag, **GEN).stream(Q, config={"callbacks": [recorder]}))
    assert len(recorder.ends) == 1 and recorder.errors == []  # read to the end: ended once, no error after


def test_an_empty_document_list_still_checks_the_question_and_options(rag):
    from kvrag import EmptyInputError

    with pytest.raises(EmptyInputError, match="question is empty"):
        KVRAGRunnable(engine=rag).invoke({"question": "  ", "documents": []})
    with pytest.raises(InvalidRequestError, match="strategy"):
        KVRAGRunnable(engine=rag).invoke(
            {"question": Q, "documents": []}, config={"configurable": {"strategy": "no_such_strategy"}}
        )
