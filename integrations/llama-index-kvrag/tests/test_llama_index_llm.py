"""KVRAGLLM on a tiny model: a chat LLM over the model's chat template, LlamaIndex's token counts, one LLM event a
call, and its arguments checked where it is built."""

import asyncio

import pytest
from llama_index.core import Settings
from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler, TokenCountingHandler
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.prompts import PromptTemplate
from llama_index.llms.kvrag import KVRAGLLM
from tiny import HashEmbedder

from kvrag import KVRAG, InvalidRequestError, KVModel, MemoryStore
from kvrag.answer import last_answer

MESSAGES = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Say hi.")]
TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def kvmodel(model_dir):
    return KVModel.from_pretrained(model_dir)


def generate(kvmodel, prompt, n):
    """What the model generates from exactly this prompt text."""
    return last_answer(kvmodel.stream_prompt(prompt, max_new_tokens=n))


def n_ids(kvmodel, text):
    return len(kvmodel.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_chat_applies_the_models_chat_template_in_every_mode(kvmodel):
    llm = KVRAGLLM(kvmodel, max_new_tokens=6)
    assert llm.metadata.is_chat_model and llm.metadata.context_window == kvmodel.max_positions
    prompt = kvmodel.layout.chat_prompt(TURNS)
    assert prompt.startswith("<|im_start|>system\nBe brief.") and prompt.endswith("<|im_start|>assistant\n")
    expected = generate(kvmodel, prompt, 6)
    usage = {
        "prompt_tokens": n_ids(kvmodel, prompt),
        "completion_tokens": expected.stats.new_tokens,
        "total_tokens": n_ids(kvmodel, prompt) + expected.stats.new_tokens,
    }

    chat = llm.chat(MESSAGES)
    assert chat.message.role == MessageRole.ASSISTANT and chat.message.content == expected.text
    assert chat.additional_kwargs == usage and chat.raw["usage"] == usage
    assert chat.raw["finish_reason"] == expected.finish_reason and chat.raw["stats"]["strategy"] == "full_prefill"
    streamed = list(llm.stream_chat(MESSAGES))
    assert "".join(r.delta for r in streamed) == expected.text == streamed[-1].message.content
    assert streamed[-1].additional_kwargs == usage  # the last chunk carries the counts

    async def both():
        done = await llm.achat(MESSAGES)
        pieces = [r async for r in await llm.astream_chat(MESSAGES)]
        return done, pieces

    done, pieces = asyncio.run(both())
    assert done.message.content == expected.text and done.additional_kwargs == usage
    assert "".join(r.delta for r in pieces) == expected.text and pieces[-1].additional_kwargs == usage


def test_completion_prompts_formatted_or_not(kvmodel):
    llm = KVRAGLLM(kvmodel, max_new_tokens=5)
    one_turn = kvmodel.layout.chat_prompt([{"role": "user", "content": "Say hi."}])
    # formatted=False: one user turn of the chat template; formatted=True: the prompt as given
    plain = llm.complete("Say hi.")
    assert plain.text == generate(kvmodel, one_turn, 5).text
    assert plain.additional_kwargs["prompt_tokens"] == n_ids(kvmodel, one_turn)
    raw = llm.complete("Say hi.", formatted=True)
    assert raw.text == generate(kvmodel, "Say hi.", 5).text and raw.additional_kwargs["prompt_tokens"] == 7
    streamed = list(llm.stream_complete("Say hi."))
    assert streamed[-1].text == plain.text and streamed[-1].additional_kwargs == plain.additional_kwargs
    assert asyncio.run(llm.acomplete("Say hi.")).text == plain.text
    # a system prompt goes in the template's system turn
    system = KVRAGLLM(kvmodel, max_new_tokens=5, system_prompt="Be brief.").complete("Say hi.")
    assert system.additional_kwargs["prompt_tokens"] == n_ids(kvmodel, kvmodel.layout.chat_prompt(TURNS))


def test_stock_predict_sends_chat_messages(kvmodel):
    llm = KVRAGLLM(kvmodel, max_new_tokens=5)
    expected = llm.chat([ChatMessage(role="user", content="Say hi.")]).message.content
    assert llm.predict(PromptTemplate("Say {what}."), what="hi") == expected  # is_chat_model: chat, not a raw prompt
    assert "".join(llm.stream(PromptTemplate("Say {what}."), what="hi")) == expected


def test_token_counts_reach_llama_index_token_counter(kvmodel):
    # A character "tokenizer": the counter falls back to it only if the response carries no counts.
    counter = TokenCountingHandler(tokenizer=list)
    llm = KVRAGLLM(kvmodel, max_new_tokens=4, callback_manager=CallbackManager([counter]))
    chat = llm.chat(MESSAGES)
    done = llm.complete("Say hi.")
    assert (
        counter.prompt_llm_token_count
        == chat.additional_kwargs["prompt_tokens"] + done.additional_kwargs["prompt_tokens"]
    )
    assert counter.completion_llm_token_count == chat.raw["stats"]["new_tokens"] + done.raw["stats"]["new_tokens"]


def test_one_llm_event_a_call(kvmodel):
    debug = LlamaDebugHandler()
    llm = KVRAGLLM(kvmodel, max_new_tokens=3, callback_manager=CallbackManager([debug]))
    llm.chat(MESSAGES)
    list(llm.stream_chat(MESSAGES))
    asyncio.run(llm.achat(MESSAGES))
    llm.complete("Say hi.")
    pairs = debug.get_event_pairs(CBEventType.LLM)
    assert len(pairs) == 4 and all(len(p) == 2 for p in pairs)  # no chat event wrapping a completion event


def test_settings_llm(kvmodel):
    previous = Settings._llm
    Settings.llm = KVRAGLLM(kvmodel, max_new_tokens=5)
    try:
        done = Settings.llm.complete("Say hi.")
        assert done.text == list(Settings.llm.stream_complete("Say hi."))[-1].text and done.raw["stats"]["new_tokens"]
    finally:
        Settings._llm = previous


def test_arguments_checked_where_it_is_built(kvmodel):
    engine = KVRAG(kvmodel, embedder=HashEmbedder(), store=MemoryStore())
    with pytest.raises(InvalidRequestError, match=r"KVRAGLLM\(engine.kvmodel\)"):
        KVRAGLLM(engine)
    with pytest.raises(InvalidRequestError, match="KVModel.from_pretrained"):
        KVRAGLLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be at least 1"):
        KVRAGLLM(kvmodel, max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="temperature must be a finite number >= 0"):
        KVRAGLLM(kvmodel, temperature=-1)
    with pytest.raises(InvalidRequestError, match="top_p must be in"):
        KVRAGLLM(kvmodel, top_p=2.0)
    llm = KVRAGLLM(kvmodel, max_new_tokens=2, stop="\n")
    assert llm.stop == ["\n"]
    with pytest.raises(InvalidRequestError, match="unknown argument.*foo.*max_new_tokens"):
        llm.complete("Say hi.", foo=1)
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be at least 1"):
        llm.chat(MESSAGES, max_new_tokens=0)
    assert llm.complete("Say hi.", max_new_tokens=1).raw["stats"]["new_tokens"] <= 1  # a per-call override
