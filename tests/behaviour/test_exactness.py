"""The recompute primitive against full prefill, on tiny random models of every supported architecture.

(b) S = all context tokens; (c) S = a middle chunk with the other chunks' KV from a full prefill (a
non-contiguous physical order under the mask); (d) reuse of one chunk; (e) greedy tokens after an exact
plan. Each case also has a control that must differ, so the comparison can fail.
"""

import pytest
import torch
from tiny import ARCHS, VOCAB, tiny_model

from kvrag.cache.kv import ChunkKV
from kvrag.model.encode import encode_chunks, encode_prefix, encode_runs, stacked_kv
from kvrag.model.rope import Repositioner
from kvrag.run.generate import Sampling, decode
from kvrag.run.recompute import full_prefill, recompute

ARCH_NAMES = sorted(ARCHS)
TOL = 2e-4


def random_ids(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=ARCH_NAMES)
def setup(request):
    model = tiny_model(request.param)
    prefix_ids = random_ids(7, 1)
    chunk_ids = [random_ids(n, 10 + i) for i, n in enumerate((11, 6, 9))]
    suffix_ids = random_ids(5, 2)
    prefix = encode_prefix(model, prefix_ids)
    chunks = encode_chunks(model, prefix, chunk_ids)
    return model, Repositioner(model), prefix, chunks, prefix_ids, chunk_ids, suffix_ids


def reference(model, prefix_ids, chunk_ids, suffix_ids, order):
    ids = prefix_ids + [t for c in order for t in chunk_ids[c]] + suffix_ids
    return full_prefill(model, ids, logits_to_keep=len(suffix_ids)), ids


def full_prefill_chunks(model, prefix_ids, chunk_ids, suffix_ids):
    """Each chunk's KV sliced from one full prefill, at its true position."""
    ref, _ = reference(model, prefix_ids, chunk_ids, suffix_ids, range(len(chunk_ids)))
    out, pos = [], len(prefix_ids)
    for ids in chunk_ids:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(ids))
        out.append(ChunkKV(torch.tensor(ids), k, v, start=pos))
        pos += len(ids)
    return ref, out


def max_diff(a, b):
    return (a - b).abs().max().item()


def test_b_recompute_all_context_equals_full_prefill(setup):
    model, rep, prefix, chunks, prefix_ids, chunk_ids, suffix_ids = setup
    order = [2, 0, 1]
    S = {c: torch.arange(len(chunk_ids[c])) for c in order}
    got = recompute(model, rep, prefix, chunks, order, S, suffix_ids, logits_to_keep=len(suffix_ids))
    ref, _ = reference(model, prefix_ids, chunk_ids, suffix_ids, order)
    assert got.recomputed_tokens == sum(map(len, chunk_ids))
    assert max_diff(got.logits, ref.logits) < TOL
    plain = recompute(model, rep, prefix, chunks, order, {}, suffix_ids, logits_to_keep=len(suffix_ids))
    assert max_diff(plain.logits, ref.logits) > 1e-2, "stitching alone should not be exact here"


def test_c_middle_chunk_recomputed_with_exact_neighbours_equals_full_prefill(setup):
    model, rep, prefix, _, prefix_ids, chunk_ids, suffix_ids = setup
    ref, exact = full_prefill_chunks(model, prefix_ids, chunk_ids, suffix_ids)
    # The middle chunk's stored KV is garbage: recomputing it must not read it.
    garbage = ChunkKV(
        exact[1].token_ids, torch.randn_like(exact[1].keys) * 5, torch.randn_like(exact[1].values), start=exact[1].start
    )
    chunks = [exact[0], garbage, exact[2]]
    got = recompute(
        model,
        rep,
        prefix,
        chunks,
        [0, 1, 2],
        {1: torch.arange(len(chunk_ids[1]))},
        suffix_ids,
        logits_to_keep=len(suffix_ids),
    )
    assert max_diff(got.logits, ref.logits) < TOL
    # The middle chunk's fresh KV sits at the end of the physical cache and equals full prefill's.
    P, n1 = len(prefix_ids), len(chunk_ids[1])
    fresh_k, _ = stacked_kv(
        got.cache, 0, got.cache.get_seq_length() - len(suffix_ids) - n1, got.cache.get_seq_length() - len(suffix_ids)
    )
    assert max_diff(fresh_k, stacked_kv(ref.cache, 0, P + len(chunk_ids[0]), P + len(chunk_ids[0]) + n1)[0]) < TOL
    # Control: declaring the last chunk 3 positions off (so it is rotated wrongly) breaks equality.
    shifted = ChunkKV(exact[2].token_ids, exact[2].keys, exact[2].values, start=exact[2].start + 3)
    bad = recompute(
        model,
        rep,
        prefix,
        [exact[0], garbage, shifted],
        [0, 1, 2],
        {1: torch.arange(n1)},
        suffix_ids,
        logits_to_keep=len(suffix_ids),
    )
    assert max_diff(bad.logits, ref.logits) > 1e-3


def test_c_scattered_token_set_equals_full_prefill(setup):
    model, rep, prefix, _, prefix_ids, chunk_ids, suffix_ids = setup
    ref, exact = full_prefill_chunks(model, prefix_ids, chunk_ids, suffix_ids)
    S = {0: torch.tensor([0, 3, 10]), 1: torch.tensor([2]), 2: torch.tensor([1, 2, 8])}
    got = recompute(model, rep, prefix, exact, [0, 1, 2], S, suffix_ids, logits_to_keep=len(suffix_ids))
    assert got.recomputed_tokens == 7
    assert max_diff(got.logits, ref.logits) < TOL


def test_d_reuse_of_one_chunk_equals_full_prefill(setup):
    model, rep, prefix, chunks, prefix_ids, chunk_ids, suffix_ids = setup
    got = recompute(model, rep, prefix, chunks[:1], [0], {}, suffix_ids, logits_to_keep=len(suffix_ids))
    ref, _ = reference(model, prefix_ids, chunk_ids[:1], suffix_ids, [0])
    assert got.recomputed_tokens == 0
    assert max_diff(got.logits, ref.logits) < TOL


def test_e_greedy_tokens_after_exact_plan_equal_full_prefill(setup):
    model, rep, prefix, _, prefix_ids, chunk_ids, suffix_ids = setup
    ref, exact = full_prefill_chunks(model, prefix_ids, chunk_ids, suffix_ids)
    got = recompute(model, rep, prefix, exact, [0, 1, 2], {1: torch.arange(len(chunk_ids[1]))}, suffix_ids)
    sampling = Sampling(max_new_tokens=12)
    tokens = list(decode(model, got.cache, got.logits[-1], got.next_position, sampling, eos_ids=[]))
    ref_tokens = list(decode(model, ref.cache, ref.logits[-1], ref.next_position, sampling, eos_ids=[]))
    assert tokens == ref_tokens and len(tokens) == 12
    # and the same as transformers' own generate on the full ids
    ids = prefix_ids + [t for c in chunk_ids for t in c] + suffix_ids
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, min_new_tokens=12, pad_token_id=0)
    assert out[0, len(ids) :].tolist() == ref_tokens


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_eager_attention_gives_the_same_result(arch):
    model = tiny_model(arch, attn="eager")
    rep = Repositioner(model)
    prefix_ids, suffix_ids = random_ids(6, 3), random_ids(4, 4)
    chunk_ids = [random_ids(8, 5), random_ids(7, 6)]
    prefix = encode_prefix(model, prefix_ids)
    chunks = encode_chunks(model, prefix, chunk_ids)
    got = recompute(
        model, rep, prefix, chunks, [1, 0], {0: torch.arange(8), 1: torch.arange(7)}, suffix_ids, logits_to_keep=4
    )
    ref, _ = reference(model, prefix_ids, chunk_ids, suffix_ids, [1, 0])
    assert max_diff(got.logits, ref.logits) < TOL


def test_a_documents_chunks_encoded_in_context_and_stitched_in_order_equal_its_full_prefill(setup):
    """Chunks encoded in their document's context (one run) and stitched in document order: nothing recomputed,
    exactly the full prefill; the same chunks encoded alone are not."""
    model, rep, prefix, alone, prefix_ids, chunk_ids, suffix_ids = setup
    (run,) = encode_runs(model, prefix, [chunk_ids])
    assert [kv.start for kv in run] == [7, 7 + 11, 7 + 11 + 6]
    ref, _ = reference(model, prefix_ids, chunk_ids, suffix_ids, [0, 1, 2])
    got = recompute(model, rep, prefix, run, [0, 1, 2], {}, suffix_ids, logits_to_keep=len(suffix_ids))
    assert got.recomputed_tokens == 0
    assert max_diff(got.logits, ref.logits) < TOL
    plain = recompute(model, rep, prefix, alone, [0, 1, 2], {}, suffix_ids, logits_to_keep=len(suffix_ids))
    assert max_diff(plain.logits, ref.logits) > 1e-2, "chunks encoded alone should not be exact here"
    # a run's first chunk is encoded alone: its KV is the alone encoding's
    assert max_diff(run[0].keys, alone[0].keys) < TOL and max_diff(run[1].keys, alone[1].keys) > 1e-3
