"""Batched chunk encoding: padding never changes a chunk's KV; order is kept."""

import pytest
import torch
from tiny import VOCAB, tiny_model

from kvrag.model.encode import context_runs, encode_chunks, encode_prefix, encode_runs, length_batches


@pytest.mark.parametrize("arch", ["llama", "gpt_neox", "qwen3"])
def test_batched_encoding_equals_one_chunk_at_a_time(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(0)
    prefix = encode_prefix(model, torch.randint(0, VOCAB, (6,), generator=g).tolist())
    chunk_ids = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 9, 17, 1, 12)]
    batched = encode_chunks(model, prefix, chunk_ids, batch_tokens=10_000)
    single = encode_chunks(model, prefix, chunk_ids, batch_tokens=0)
    for b, s, ids in zip(batched, single, chunk_ids):
        assert b.token_ids.tolist() == ids and b.start == 6
        assert b.keys.shape == (
            2,
            model.config.num_key_value_heads if arch != "gpt_neox" else 4,
            len(ids),
            b.keys.shape[3],
        )
        assert torch.allclose(b.keys, s.keys, atol=1e-5) and torch.allclose(b.values, s.values, atol=1e-5)


def test_batches_respect_the_token_bound_and_cover_every_chunk():
    lengths = [5, 50, 7, 49, 3, 100]
    groups = length_batches(lengths, batch_tokens=100)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        assert len(g) == 1 or max(lengths[i] for i in g) * len(g) <= 100


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_runs_batched_equal_runs_one_at_a_time_and_their_chunks_sit_where_the_run_puts_them(arch):
    model = tiny_model(arch)
    g = torch.Generator().manual_seed(1)
    prefix = encode_prefix(model, torch.randint(0, VOCAB, (5,), generator=g).tolist())
    runs = [[torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in run] for run in ([4, 9], [13], [2, 2, 7])]
    batched = encode_runs(model, prefix, runs, batch_tokens=10_000)
    single = encode_runs(model, prefix, runs, batch_tokens=0)
    for run, b_run, s_run in zip(runs, batched, single):
        at = 5
        for ids, b, s in zip(run, b_run, s_run):
            assert b.token_ids.tolist() == ids and b.start == at
            assert torch.allclose(b.keys, s.keys, atol=1e-5) and torch.allclose(b.values, s.values, atol=1e-5)
            at += len(ids)


def test_context_runs_keep_document_order_within_the_window():
    assert context_runs([3, 4, 5, 9, 1], window=10) == [[0, 1], [2], [3, 4]]
    assert context_runs([12, 2], window=10) == [[0], [1]]  # a chunk longer than the window is a run of its own
    assert context_runs([], window=10) == []
