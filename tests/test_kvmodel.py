"""KVModel, the public surface: strategies, stats, streaming, errors, the strategy registry."""

import pytest
import torch
from tiny import byte_tokenizer, in_threads, tiny_model

from kvrag import (
    STRATEGIES,
    Answer,
    ContextOverflowError,
    EmptyInputError,
    InvalidRequestError,
    KVModel,
    Plan,
    register_strategy,
)

CHUNKS = ["The first document is about cats.", "The second one is about ships and harbours.", "A third, shorter text."]


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


def test_full_prefill_matches_transformers_generate(kv):
    a = kv.answer("What is it about?", CHUNKS, strategy="full_prefill", max_new_tokens=10)
    ids = kv.prompt_ids("What is it about?", [kv.layout.chunk_ids(c) for c in CHUNKS], [0, 1, 2])
    with torch.inference_mode():
        out = kv.model.generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=kv.eos_ids
        )
    expected = [t for t in out[0, len(ids) :].tolist() if t not in kv.eos_ids]
    assert a.token_ids == expected
    assert a.stats.recomputed_tokens == a.stats.context_tokens == sum(len(kv.layout.chunk_ids(c)) for c in CHUNKS)
    assert a.stats.prompt_tokens == len(ids) and a.stats.chunks_encoded == 0


def test_strategies_report_what_they_did(kv):
    chunks = kv.encode(CHUNKS)
    lengths = [len(c) for c in chunks]
    reuse = kv.answer("Which one is about ships?", chunks, strategy="reuse", max_new_tokens=4)
    assert reuse.stats.recomputed_tokens == 0 and reuse.stats.order == [0, 1, 2] and reuse.stats.target is None
    tr = kv.answer("Which one is about ships?", chunks, target=1, max_new_tokens=4)
    assert tr.stats.strategy == "target_recompute" and tr.stats.order == [0, 2, 1] and tr.stats.target == 1
    assert tr.stats.recomputed_tokens == lengths[1]
    assert tr.stats.recomputed_fraction == pytest.approx(lengths[1] / sum(lengths))
    assert 0 < tr.stats.ttft_s <= tr.stats.total_s


def test_target_picked_from_scores_or_rank(kv):
    chunks = kv.encode(CHUNKS)
    assert kv.answer("q?", chunks, scores=[0.1, 0.2, 0.9], max_new_tokens=1).stats.target == 2
    assert kv.answer("q?", chunks, max_new_tokens=1).stats.target == 0


def test_text_chunks_and_encoded_chunks_give_the_same_answer(kv):
    from_text = kv.answer("About cats?", CHUNKS, target=0, max_new_tokens=8)
    from_kv = kv.answer("About cats?", kv.encode(CHUNKS), target=0, max_new_tokens=8)
    assert from_text.token_ids == from_kv.token_ids
    assert from_text.stats.chunks_encoded == 3 and from_kv.stats.chunks_encoded == 0
    assert from_text.stats.encode_s > 0 and from_kv.stats.encode_s == 0


def test_stream_yields_pieces_then_the_answer(kv):
    items = list(kv.stream("About cats?", CHUNKS, max_new_tokens=12))
    *pieces, answer = items
    assert isinstance(answer, Answer) and all(isinstance(p, str) for p in pieces)
    assert "".join(pieces) == answer.text
    assert answer.finish_reason in ("length", "eos")


def test_stop_strings_and_length_limit(kv):
    free = kv.answer("About cats?", CHUNKS, max_new_tokens=12)
    assert free.finish_reason == "length" and free.stats.new_tokens == 12
    stop = next(free.text[i : i + 2] for i in range(1, len(free.text) - 1) if "\ufffd" not in free.text[i : i + 2])
    cut = kv.answer("About cats?", CHUNKS, max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]


def test_seeded_sampling_is_reproducible(kv):
    a = kv.answer("About cats?", CHUNKS, max_new_tokens=8, temperature=1.0, seed=7)
    b = kv.answer("About cats?", CHUNKS, max_new_tokens=8, temperature=1.0, seed=7)
    assert a.token_ids == b.token_ids


def test_threads_share_one_model_safely(kv):
    chunks = kv.encode(CHUNKS)
    serial = [kv.answer(f"Question {i}?", chunks, target=i % 3, max_new_tokens=6).token_ids for i in range(4)]
    assert (
        in_threads(lambda i: kv.answer(f"Question {i}?", chunks, target=i % 3, max_new_tokens=6).token_ids, 4) == serial
    )


def test_a_user_strategy_runs_through_the_engine(kv):
    @register_strategy("last_first_recompute", description="put the last chunk first and recompute it")
    def last_first(request):
        n = len(request.lengths)
        return Plan(order=[n - 1, *range(n - 1)], recompute={n - 1: torch.arange(request.lengths[n - 1])})

    try:
        a = kv.answer("q?", CHUNKS, strategy="last_first_recompute", max_new_tokens=2)
        assert a.stats.order == [2, 0, 1] and a.stats.recomputed_tokens == len(kv.layout.chunk_ids(CHUNKS[2]))
    finally:
        del STRATEGIES["last_first_recompute"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"strategy": "magic"}, InvalidRequestError, "unknown strategy 'magic': use one of .*full_prefill"),
        ({"target": 3}, InvalidRequestError, r"target 3 is not a chunk index: use an int in 0..2"),
        ({"scores": [1.0]}, InvalidRequestError, "scores has 1 entries for 3 chunks"),
        ({"budget": 0}, InvalidRequestError, r"budget must be .* \(0, 1\]"),
        ({"budget": 1.5}, InvalidRequestError, "budget"),
        ({"max_new_tokens": 0}, InvalidRequestError, "max_new_tokens"),
    ],
)
def test_bad_arguments_are_clear_errors(kv, kwargs, error, match):
    with pytest.raises(error, match=match):
        kv.answer("q?", CHUNKS, **kwargs)


def test_bad_inputs_are_clear_errors(kv):
    with pytest.raises(EmptyInputError, match="no chunks"):
        kv.answer("q?", [])
    with pytest.raises(EmptyInputError, match="chunk is empty"):
        kv.answer("q?", ["fine", "   "])
    with pytest.raises(EmptyInputError, match="question is empty"):
        kv.answer(" ", CHUNKS)
    with pytest.raises(ContextOverflowError, match=r"chunk 0 has \d+ tokens, more than the \d+ that fit"):
        kv.encode(["x" * 600])
    with pytest.raises(
        ContextOverflowError,
        match=r"stitched prompt has \d+ tokens and max_new_tokens is 64: \d+ > "
        r"the model's 512-token context",
    ):
        kv.answer("q?", ["y" * 200] * 3, max_new_tokens=64)
    with pytest.raises(InvalidRequestError, match="give a str or a ChunkKV"):
        kv.answer("q?", [42])


def test_kv_from_another_model_or_dtype_is_refused(kv):
    other = KVModel(tiny_model("qwen3"), byte_tokenizer())
    with pytest.raises(InvalidRequestError, match="encoded by another model"):
        kv.answer("q?", other.encode(["a text"]))
    chunk = kv.encode(["a text"])[0]
    chunk.keys = chunk.keys.half()
    with pytest.raises(InvalidRequestError, match="float16"):
        kv.answer("q?", [chunk])
    chunk.keys, chunk.encoder = chunk.keys.float(), ""
    with pytest.raises(InvalidRequestError, match="encoder unknown"):
        kv.answer("q?", [chunk])


def test_a_paused_stream_blocks_nobody_and_resumes_on_another_thread(kv):
    from concurrent.futures import ThreadPoolExecutor

    chunks = kv.encode(CHUNKS)
    whole = kv.answer("About cats?", chunks, max_new_tokens=10)
    stream = kv.stream("About cats?", chunks, max_new_tokens=10)
    first = next(stream)
    with ThreadPoolExecutor(1) as a, ThreadPoolExecutor(1) as b:
        # another request completes while the stream is paused, and the stream resumes on two other threads
        other = a.submit(kv.answer, "About ships?", chunks, max_new_tokens=3).result(timeout=60)
        rest = [b.submit(next, stream).result(timeout=60)]
        rest += a.submit(list, stream).result(timeout=60)
    assert other.stats.new_tokens == 3
    assert first + "".join(p for p in rest if isinstance(p, str)) == whole.text
    assert isinstance(rest[-1], Answer) and rest[-1].token_ids == whole.token_ids
    assert kv.lock.acquire(timeout=1)
    kv.lock.release()


def test_numpy_targets_and_bad_scores(kv):
    import numpy as np

    chunks = kv.encode(CHUNKS)
    assert kv.answer("q?", chunks, target=np.int64(2), budget=np.float32(0.5), max_new_tokens=1).stats.target == 2
    with pytest.raises(InvalidRequestError, match="scores must be finite"):
        kv.answer("q?", chunks, scores=[float("nan"), 0.9, 0.1], max_new_tokens=1)
    moved = chunks[0].to("cpu", torch.float64)
    assert moved.keys.dtype == torch.float64 and torch.equal(moved.token_ids, chunks[0].token_ids)


def test_flash_attention_and_an_empty_prefix_are_refused():
    from kvrag import LayoutError, PromptLayout, UnsupportedModelError

    model = tiny_model("llama", seed=5)
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(UnsupportedModelError, match="flash_attention_2.*sdpa"):
            KVModel(model, byte_tokenizer())
    finally:
        model.config._attn_implementation = "sdpa"
    with pytest.raises(LayoutError, match="prefix is empty"):
        PromptLayout(byte_tokenizer(chat_template=None), header="")
