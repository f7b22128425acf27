"""kvrag.model.batch: many prompts of different lengths as one left-padded batch decode and teacher-force as each
prompt alone."""

from __future__ import annotations

import torch
from tiny import FACTS, byte_tokenizer, tiny_model

from kvrag.model.kvmodel import KVModel
from kvrag.model.batch import PaddedBatch
from kvrag.model.recompute import full_prefill


def stop_ids(kv: KVModel) -> set[int]:
    """Tokens whose text holds a line break (where the study's answers end)."""
    return {i for i in kv.tokenizer.get_vocab().values() if "\n" in kv.tokenizer.decode([i])}


def greedy_alone(kv: KVModel, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of one prompt by plain forwards over its whole text, up to a line break."""
    ids = list(prompt)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            token = int(kv.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in stop_ids(kv):
                break
    return out


def test_batched_greedy_decoding_equals_decoding_each_prompt_alone() -> None:
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    ids = [kv.layout.chunk_ids(text) for text, _ in FACTS[:3]]
    prompts = [kv.prompt_ids("Who?", ids, order) for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0])]
    alone = [greedy_alone(kv, p, 12) for p in prompts]
    batch = PaddedBatch.of_prefills(kv.model, [full_prefill(kv.model, p) for p in prompts], room=12)
    assert batch.greedy(12, stop_ids(kv)) == alone
    assert len({tuple(tokens) for tokens in alone}) > 1  # the orders really give different answers


def test_one_batch_of_prompts_of_different_lengths_decodes_and_forces_as_each_prompt_alone() -> None:
    """Left padding behind a mask: a short closed-book-like prompt and long ones in one batch give each row's
    own greedy answer and teacher-forced logits; rows that finish early leave the batch (a smaller copy)."""
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    ids = [kv.layout.chunk_ids(text) for text, _ in FACTS[:3]]
    prompts = [kv.prompt_ids("Who?", ids, [0, 1, 2]), kv.prompt_ids("Who?", [], []), kv.prompt_ids("Who?", ids, [2])]
    assert len({len(p) for p in prompts}) == 3
    alone = [greedy_alone(kv, p, 12) for p in prompts]
    prefills = [full_prefill(kv.model, p) for p in prompts]
    batch = PaddedBatch.of_prefills(kv.model, prefills, room=12)
    assert batch.greedy(12, stop_ids(kv)) == alone
    forced = [[7, 8, 9, 10], [11], []]
    for prompt, sequence, logits in zip(prompts, forced, batch.teacher_forced(forced)):
        with torch.inference_mode():
            whole = kv.model(input_ids=torch.tensor([prompt + sequence])).logits[0, len(prompt) - 1 :]
        assert logits.shape == whole.shape
        torch.testing.assert_close(logits, whole.float(), rtol=1e-4, atol=1e-4)
    for prefill, prompt in zip(prefills, prompts):  # the prefills themselves are untouched
        assert prefill.cache.get_seq_length() == len(prompt)


def test_the_question_behind_each_chunk_scores_as_a_plain_forward() -> None:
    """of_chunks: one row a chunk behind the prefix, no re-positioning; the suffix's logits are those of a
    plain forward over prefix + chunk + suffix."""
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    texts = [text for text, _ in FACTS[:3]]
    chunks = kv.encode(texts)
    suffix = torch.tensor(kv.layout.suffix_ids("Who?"))
    batch = PaddedBatch.of_chunks(kv.model, kv.prefix, chunks, room=len(suffix))
    logits = batch.forward(suffix.expand(len(chunks), -1), 0)
    for row, chunk in enumerate(chunks):
        ids = [*kv.layout.prefix_ids, *chunk.token_ids.tolist(), *suffix.tolist()]
        with torch.inference_mode():
            whole = kv.model(input_ids=torch.tensor([ids])).logits[0, -len(suffix) :]
        torch.testing.assert_close(logits[row], whole.float(), rtol=1e-4, atol=1e-4)
