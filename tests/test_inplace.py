"""Reading reused KV where it is stored: the prefill kernel over segments (queries rotated per moved chunk) is as
close to float32 attention as the kernel over a stitched cache, and a `recompute` that defers its stitch gives the
stitched one's answers, writes the same cache when it is read, and never lets an attention see unwritten slots."""

import copy

import pytest
import torch
from tiny import VOCAB, tiny_config
from transformers import AutoModelForCausalLM

from kvrag import attention, ckernel
from kvrag import recompute as rc
from kvrag.attention import use_gqa_sdpa
from kvrag.encode import encode_chunks, encode_prefix
from kvrag.rope import Repositioner

needs_bf16_kernel = pytest.mark.skipif(
    not ckernel.prefill_attention_available(), reason="no AVX512-BF16 CPU or no compiler: the stitch is written"
)


def _rotate(x, cos, sin):
    """x [..., D] rotated on its first cos.shape[-1] dims (rotate-half), in float32."""
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    head = x[..., :rot]
    turned = torch.cat((-head[..., half:], head[..., :half]), -1)
    return torch.cat((head * cos + turned * sin, x[..., rot:]), -1)


def _angles(shift, rot):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    a = torch.cat((shift * inv, shift * inv))
    return a.cos(), a.sin()


def _segmented(g, kv_heads, d, rot, lengths, n):
    """A cache of slots in pieces: an unmoved prefix, chunks stored `shift` positions earlier than their slots,
    then n new tokens. Returns keys as stored, the keys every slot should attend to (moved, float32), values,
    the Segments and what they address."""
    keep, rows, cos_rows, sin_rows, moved, stored_all, values_all = [], [], [], [], [], [], []
    at = 0
    for j, m in enumerate(lengths):
        shift = 0 if j == 0 else 37 * j + 5
        cos, sin = _angles(float(shift), rot)
        true = torch.randn(kv_heads, m, d, generator=g) * 2
        stored = _rotate(true, cos, -sin).bfloat16()  # encoded `shift` positions earlier
        values = torch.randn(kv_heads, m, d, generator=g).bfloat16()
        keep += [stored, values]
        moved.append(_rotate(stored.float(), cos, sin))
        stored_all.append(stored)
        values_all.append(values)
        rows.append([at, m, stored.data_ptr(), values.data_ptr(), m * d, d, -1 if j == 0 else j])
        cos_rows.append(cos)
        sin_rows.append(-sin)
        at += m
    new_keys = torch.randn(kv_heads, n, d, generator=g).bfloat16()
    new_values = torch.randn(kv_heads, n, d, generator=g).bfloat16()
    keep += [new_keys, new_values]
    rows.append([at, n, new_keys.data_ptr(), new_values.data_ptr(), n * d, d, -1])
    moved.append(new_keys.float())
    values_all.append(new_values)
    segments = ckernel.Segments(torch.tensor(rows), torch.stack(cos_rows), torch.stack(sin_rows))
    return segments, torch.cat(moved, 1), torch.cat(values_all, 1), stored_all, keep


@needs_bf16_kernel
@pytest.mark.parametrize(
    "heads, kv_heads, d, rot, lengths",
    [
        (9, 3, 64, 64, [5, 200, 64, 1, 130, 65]),  # the embedded model's heads; a chunk of one, of a whole block
        (4, 2, 128, 128, [3, 77, 250]),
        (8, 1, 64, 32, [4, 90, 33]),  # partial rotary: the other dims unrotated
        (2, 2, 32, 32, [2, 40, 129]),
    ],
)
@pytest.mark.parametrize("n", [30, 1 + 16])
def test_the_kernel_over_segments_is_as_close_to_float32_attention_as_over_a_stitched_cache(
    heads, kv_heads, d, rot, lengths, n
):
    g = torch.Generator().manual_seed(n + d)
    segments, moved, values, _, keep = _segmented(g, kv_heads, d, rot, lengths, n)
    T = moved.shape[1]
    q = torch.randn(1, n, heads, d, generator=g).bfloat16().transpose(1, 2)  # strided, as a model passes it
    allowed = torch.ones(1, 1, n, T, dtype=torch.bool)
    allowed[..., T - n :] = torch.ones(n, n, dtype=torch.bool).tril()
    allowed[0, 0, 3, lengths[0] : lengths[0] + 20] = False  # a hole inside a moved chunk
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, -3.3895e38)
    stitched_keys = moved.bfloat16().unsqueeze(0)  # rotated then rounded, as the stitch writes them
    over_stitch = ckernel.prefill_attention(q, stitched_keys, values.unsqueeze(0), mask, d**-0.5)
    cache = torch.zeros(1, kv_heads, T, d, dtype=torch.bfloat16)  # what the kernel must not read: zeros
    in_place = ckernel.prefill_attention(q, cache, cache, mask, d**-0.5, segments=segments)
    assert in_place is not None and in_place.shape == (1, n, heads, d)
    group = heads // kv_heads
    scores = (q.float() @ moved.repeat_interleave(group, 0).transpose(-1, -2)) * d**-0.5
    want = (torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ values.float().repeat_interleave(group, 0))
    want = want.transpose(1, 2)
    error, stitch_error = ((x.float() - want).abs().max() for x in (in_place, over_stitch))
    assert error <= 1.5 * stitch_error + 2e-3  # the queries' rounding after their turn, as the keys' after theirs


@needs_bf16_kernel
def test_segments_the_kernel_does_not_take_are_refused():
    g = torch.Generator().manual_seed(0)
    segments, moved, _, _, keep = _segmented(g, 2, 64, 64, [4, 100, 70], 20)
    T = moved.shape[1]
    q = torch.randn(1, 4, 20, 64, generator=g).bfloat16()
    cache = torch.zeros(1, 2, T, 64, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 20, T, dtype=torch.bool)
    assert ckernel.prefill_attention(q, cache, cache, mask, 0.125, segments=segments) is not None
    gap = segments.rows.clone()
    gap[1, 0] += 1  # a slot no segment covers
    holed = ckernel.Segments(gap, segments.cos, segments.sin)
    assert ckernel.prefill_attention(q, cache, cache, mask, 0.125, segments=holed) is None
    short = ckernel.Segments(segments.rows[:-1].clone(), segments.cos, segments.sin)  # the new tokens missing
    assert ckernel.prefill_attention(q, cache, cache, mask, 0.125, segments=short) is None
    odd = ckernel.Segments(segments.rows, segments.cos[:, :30].contiguous(), segments.sin[:, :30].contiguous())
    assert ckernel.prefill_attention(q, cache, cache, mask, 0.125, segments=odd) is None  # half a rotate-half pair
    two = torch.cat((q, q))
    both = cache.expand(2, -1, -1, -1)
    assert ckernel.prefill_attention(two, both, both, None, 0.125, segments=segments) is None  # one prompt only


def _model(dtype=torch.bfloat16):
    """A tiny llama whose heads the prefill kernel takes (head size 32), on kvrag's attention."""
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(dtype)
    use_gqa_sdpa(model)
    return model


def _prompt(model, sizes=(4, 60, 41, 70, 55)):
    ids = torch.randint(0, VOCAB - 50, (sum(sizes) + 12,), generator=torch.Generator().manual_seed(7)).tolist()
    prefix = encode_prefix(model, ids[: sizes[0]])
    bounds = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    chunks = encode_chunks(model, prefix, [ids[a:b] for a, b in zip(bounds, bounds[1:])])
    return prefix, chunks, ids[bounds[-1] :]


def _recompute(model, prefix, chunks, suffix, in_place, **kwargs):
    cost = rc.IN_PLACE_COST
    rc.IN_PLACE_COST = 0 if in_place else 10**9
    try:
        return rc.recompute(model, Repositioner(model), prefix, chunks, [2, 0, 3, 1], {}, suffix, **kwargs)
    finally:
        rc.IN_PLACE_COST = cost


@needs_bf16_kernel
def test_a_recompute_read_in_place_answers_as_the_stitched_one_and_writes_the_same_cache(monkeypatch):
    model = _model()
    prefix, chunks, suffix = _prompt(model)
    reference = copy.deepcopy(model).float()
    want = _recompute(reference, *_prompt(reference), in_place=False, logits_to_keep=4).logits
    segmented = []
    kernel = ckernel.prefill_attention
    monkeypatch.setattr(
        ckernel, "prefill_attention", lambda *a, **k: segmented.append(k.get("segments") is not None) or kernel(*a, **k)
    )
    stitched = _recompute(model, prefix, chunks, suffix, in_place=False, logits_to_keep=4, room=3)
    read = _recompute(model, prefix, chunks, suffix, in_place=True, logits_to_keep=4, room=3)
    assert segmented == [False, False, True, True]  # two layers stitched, then two read in place
    assert read.cache.deferred is not None and not read.cache.deferred.written  # nothing written yet
    error, stitch_error = ((x.logits - want).abs().mean() for x in (read, stitched))
    # each path rounds once more than float32 does (the moved keys, or the turned queries, to bfloat16): about as
    # far from float32 as each other (0.93-1.09x on six seeds of this model, 1.16x on this one), and nearer each
    # other than the stitched one is to float32
    assert error <= 1.25 * stitch_error and (read.logits - stitched.logits).abs().mean() <= stitch_error
    assert read.logits.argmax(-1).tolist() == stitched.logits.argmax(-1).tolist()
    reused = len(prefix) + sum(len(c) for c in chunks)
    for a, b in zip(read.cache.layers, stitched.cache.layers):  # reading the keys writes the stitch's bytes
        assert torch.equal(a.keys[:, :, :reused], b.keys[:, :, :reused])
        assert torch.equal(a.values[:, :, :reused], b.values[:, :, :reused])
        assert a.keys.shape == b.keys.shape
    assert read.cache.deferred.written


@needs_bf16_kernel
def test_a_one_token_question_writes_the_slots_first_and_attends_as_the_stitched_prefill():
    model = _model()
    prefix, chunks, suffix = _prompt(model)
    stitched = _recompute(model, prefix, chunks, suffix[:1], in_place=False)
    read = _recompute(model, prefix, chunks, suffix[:1], in_place=True)  # one query: not the prefill kernel's
    assert read.cache.deferred is not None and read.cache.deferred.written  # by the first layer
    assert torch.equal(read.logits, stitched.logits)


@needs_bf16_kernel
def test_an_attention_that_does_not_take_the_reused_kv_stops_the_forward(monkeypatch):
    model = _model()
    prefix, chunks, suffix = _prompt(model)
    monkeypatch.setattr(attention, "_take_handed", lambda key: None)  # as an attention of another kind would
    with pytest.raises(RuntimeError, match="did not take the reused KV"):
        _recompute(model, prefix, chunks, suffix, in_place=True)
    assert attention.hand_over(None) is False  # nothing left behind for a later forward


@needs_bf16_kernel
def test_a_float32_model_or_other_attention_always_gets_the_stitch():
    model = _model(torch.float32)
    prefix, chunks, suffix = _prompt(model)
    assert _recompute(model, prefix, chunks, suffix, in_place=True).cache.deferred is None
    model = _model()
    prefix, chunks, suffix = _prompt(model)
    assert _recompute(model, prefix, chunks, suffix, in_place=True, output_attentions=True).cache.deferred is None
