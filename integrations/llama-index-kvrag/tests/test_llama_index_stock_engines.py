"""Stock LlamaIndex engines with `Settings.llm = KVRAGLLM(...)` on the embedded model: chat-templated prompts, so
answers hold the fact and streams carry no invented "A: ... B: ..." turns."""

import re

import pytest
from llama_index.core import Document, Settings, VectorStoreIndex
from llama_index.llms.kvrag import KVRAGLLM

from kvrag import KVModel

pytestmark = pytest.mark.slow
FACTS = [
    "The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.",
    "Velloria's harbour holds forty ships and is run by Orin Dask.",
    "The river Tam floods every spring, covering the lower fields.",
    "The old mill of Brenn grinds barley and rye for three villages.",
]
INVENTED_TURNS = re.compile(r"(^|\n)\s*(A|B|Q|Query|Question|User|Assistant|user|assistant)\s*:")


def test_settings_llm_in_stock_query_and_chat_engines(embed_model):
    previous = Settings._llm
    Settings.llm = KVRAGLLM(KVModel.from_pretrained(), max_new_tokens=24)
    try:
        index = VectorStoreIndex.from_documents([Document(text=t) for t in FACTS], embed_model=embed_model)
        answer = str(index.as_query_engine(similarity_top_k=2).query("Who runs Velloria's harbour?"))
        assert "Orin Dask" in answer
        engine = index.as_query_engine(similarity_top_k=2, streaming=True)
        streamed = "".join(engine.query("When was the lighthouse of Karsa built?").response_gen)
        assert "1872" in streamed and not INVENTED_TURNS.search(streamed)
        chat = index.as_chat_engine(chat_mode="context", similarity_top_k=1)
        reply = "".join(chat.stream_chat("Who runs Velloria's harbour?").response_gen)
        assert "Orin Dask" in reply and not INVENTED_TURNS.search(reply)
        chat.reset()
        assert str(chat.chat("Who runs Velloria's harbour?")) == reply  # greedy: the same turn, streamed or not
    finally:
        Settings._llm = previous
