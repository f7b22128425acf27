"""Bad input through the LangChain adapter: a clear kvrag error (type and key phrase) or a correct answer."""

import math

import pytest
from kvrag import ContextOverflowError, EmptyInputError, InvalidRequestError
from langchain_core.documents import Document

from langchain_kvrag import KVRAGRetriever, KVRAGRunnable

Q = "Who runs Velloria's harbour?"
BIG = "The tide turned and the ships came in. " * 130_000  # ~5 MB


@pytest.mark.parametrize(
    "value, error, phrase",
    [
        ("", EmptyInputError, "question is empty"),
        ("  \n\t", EmptyInputError, "question is empty"),
        ({"question": Q, "documents": [Document(page_content="   ")]}, EmptyInputError, "chunk is empty"),
        ({"question": Q, "documents": "some text"}, InvalidRequestError, "documents is a str"),
        ("Who runs \udcff?", InvalidRequestError, "not valid Unicode"),
        ({"question": Q, "documents": [Document(page_content="caf\udce9")]}, InvalidRequestError, "not valid Unicode"),
        ({"question": Q, "documents": [Document(page_content=BIG)]}, ContextOverflowError, "split it"),
        ("Why " * 200 + "?", ContextOverflowError, "context"),
        (3, InvalidRequestError, "takes a question"),
        (None, InvalidRequestError, "takes a question"),
        ({"documents": []}, InvalidRequestError, "takes a question"),
    ],
)
def test_runnable_bad_input(rag, value, error, phrase):
    with pytest.raises(error, match=phrase):
        KVRAGRunnable(engine=rag, max_new_tokens=2).invoke(value)


@pytest.mark.parametrize("k", [0, -1, 10**9])
def test_retriever_absurd_k(rag, k):
    with pytest.raises(InvalidRequestError, match="top_k must be"):
        KVRAGRetriever(engine=rag, k=k).invoke(Q)


@pytest.mark.parametrize("budget", [0, 2, math.nan, -1])
def test_runnable_absurd_budget(rag, budget):
    with pytest.raises(InvalidRequestError, match="budget must be"):
        KVRAGRunnable(engine=rag, max_new_tokens=2).with_config(configurable={"budget": budget}).invoke(Q)


@pytest.mark.parametrize("top_k", [0, -1, 10**9])
def test_runnable_absurd_top_k(rag, top_k):
    with pytest.raises(InvalidRequestError, match="top_k must be"):
        KVRAGRunnable(engine=rag, max_new_tokens=2).with_config(configurable={"top_k": top_k}).invoke(Q)


def test_a_huge_top_k_within_the_limit_answers_over_every_chunk(rag):
    out = KVRAGRunnable(engine=rag, top_k=10_000, max_new_tokens=2, return_dict=True).invoke(Q)
    assert len(out["sources"]) == len(rag.index) and out["stats"]["chunks_encoded"] == 0


def test_tool_calling_and_structured_output_are_refused_with_a_message(rag):
    from pydantic import BaseModel

    from langchain_kvrag import ChatKVRAG

    class Answer(BaseModel):
        text: str

    chat = ChatKVRAG(engine=rag)
    with pytest.raises(NotImplementedError, match="ChatKVRAG has no tool calling.*as_tool"):
        chat.bind_tools([Answer])
    with pytest.raises(NotImplementedError, match="ChatKVRAG has no tool calling"):
        chat.with_structured_output(Answer)


def test_a_llama_index_document_is_named_by_its_full_class_and_what_to_pass_is_said(rag):
    from llama_index.core import Document as LlamaDocument

    with pytest.raises(InvalidRequestError, match=r"llama_index\.core\.schema\.Document: pass langchain_core"):
        KVRAGRunnable(engine=rag, max_new_tokens=2).invoke({"question": Q, "documents": [LlamaDocument(text="x")]})
