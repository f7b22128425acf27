"""kvrag.cpu.ckernel: the decode step's C attention equals torch's, and the step uses it where it takes the cache; the
C rotation of stored keys equals torch's, and re-positioning uses it where it takes the tensors."""

import copy

import pytest
import torch
from tiny import tiny_model

from kvrag.cpu import cbf16, ckernel, cpaged
from kvrag.cpu.decode import Room, decoder_of, native_decoding
from kvrag.model.recompute import full_prefill

needs_kernel = pytest.mark.skipif(not ckernel.available(), reason="no C compiler here: the step keeps torch's")


def _reference(q, keys, values, n):
    kv_heads, _, d = keys.shape
    scores = q.view(kv_heads, -1, d) @ keys[:, :n].float().transpose(1, 2)
    return (torch.softmax(scores, -1) @ values[:, :n].float()).reshape(q.shape)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "kv_heads, group, d, capacity, n",
    [
        (3, 3, 64, 4400, 4184),  # compiled for its shape (a head size of 64 or 128, 1-4 query heads a kv head)
        (2, 4, 64, 700, 513),
        (1, 2, 128, 512, 300),
        (1, 8, 128, 512, 300),  # the general block task, G and the head size known at run time
        (2, 7, 128, 600, 300),
        (2, 1, 16, 300, 1),
        (2, 4, 32, 600, 256),
        (2, 4, 32, 600, 257),
        (1, 3, 48, 300, 77),
        (2, 6, 128, 4200, 4100),  # the Qwen2.5 1.5B's shape
        (2, 7, 64, 1200, 1136),  # the 0.5B's
    ],
)
@pytest.mark.parametrize("query", ["float32", "bfloat16, scaled by the kernel"])
def test_the_kernel_equals_softmax_attention(dtype, kv_heads, group, d, capacity, n, query):
    g = torch.Generator().manual_seed(n)
    keys, values = (torch.randn(kv_heads, capacity, d, generator=g).to(dtype) for _ in range(2))
    keys[:, n:] = values[:, n:] = 1e4  # slots past n hold anything: never read
    q = torch.randn(kv_heads * group, d, generator=g)
    if query == "float32":
        got = ckernel.decode_attention(q, keys, values, n)
    else:  # as the steps pass it: the model's query, unscaled (the scale 1/sqrt(d) is not a power of two here)
        scale = (d + 3) ** -0.5
        q = q.bfloat16().float() * 2
        got = ckernel.decode_attention(q, keys, values, n, scale=scale)
        q = q * scale
    torch.testing.assert_close(got, _reference(q, keys, values, n), rtol=1e-5, atol=2e-5)


def test_what_the_kernel_does_not_take_is_said_before_it_runs():
    keys = torch.zeros(2, 64, 64)
    assert not ckernel.supports(keys.half(), 2)  # float16: torch's attention
    assert not ckernel.supports(torch.zeros(2, 64, 24), 2)  # a head size not in 16-lane vectors
    assert not ckernel.supports(keys.transpose(0, 1), 2)  # not contiguous
    assert not ckernel.supports(keys, ckernel.MAX_GROUP + 1)
    if ckernel.available():
        assert ckernel.supports(keys, 2)
        with pytest.raises(ValueError, match="65 slots of a cache of 64"):
            ckernel.decode_attention(torch.zeros(4, 64), keys, keys, 65)
        with pytest.raises(ValueError, match="one shape and dtype"):
            ckernel.decode_attention(torch.zeros(4, 64), keys, keys.bfloat16(), 8)


def _steps_match_the_forward(model, tokens, prompt=20):
    """Decode `tokens` ids step by step after a prefill of the first `prompt`: each step's logits are those of
    one transformers forward over the whole sequence."""
    decoder = decoder_of(model)
    ids = torch.randint(3, 250, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    reference = model(torch.tensor([ids])).logits[0].float()
    room = Room.of(full_prefill(model, ids[:prompt]).cache, tokens - prompt)
    cos, sin = decoder.rotary(prompt, tokens - prompt)
    for step, token in enumerate(ids[prompt:]):
        logits = decoder.step(token, cos[step], sin[step], room.keys, room.values, room.filled + step)
        torch.testing.assert_close(logits, reference[prompt + step], rtol=1e-4, atol=1e-4)


@needs_kernel
def test_the_torch_decode_step_attends_through_the_kernel_and_keeps_its_logits(monkeypatch):
    model = tiny_model("llama")
    calls = []
    run = ckernel.decode_attention
    monkeypatch.setattr(ckernel, "decode_attention", lambda *a: calls.append(a[3]) or run(*a))
    native_decoding(model, False)  # the whole step in C calls the kernel from C
    try:
        _steps_match_the_forward(model, 40)
    finally:
        native_decoding(model, True)
    layers = model.config.num_hidden_layers
    assert calls == [n for n in range(21, 41) for _ in range(layers)]  # every layer, over every filled slot


def test_without_a_compiler_there_is_no_kernel_and_the_step_keeps_torchs_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built before
    ckernel._library.cache_clear()
    try:
        assert not ckernel.available() and not ckernel.supports(torch.zeros(2, 64, 64), 2)
        model = copy.deepcopy(tiny_model("qwen3"))  # its own decoder, made without the kernels
        _steps_match_the_forward(model, 30)
        assert decoder_of(model).native is None
        cbf16._prefill_library.cache_clear()
        q = torch.randn(1, 4, 8, 64).bfloat16()
        assert cbf16.prefill_attention(q, q[:, :2], q[:, :2], None, 0.125, causal=True) is None  # torch's, then
    finally:
        ckernel._library.cache_clear()  # the next test builds or finds the kernel again
        cbf16._prefill_library.cache_clear()


@needs_kernel
def test_loading_the_kernel_leaves_the_processs_floating_point_as_it_was():
    """Linked with -ffast-math, a shared library flushes subnormals to zero for every caller in the process."""
    assert ckernel.available()
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 subnormal
    assert (tiny * 1.0).item() > 0 and 5e-324 * 2 > 0


def _torch_rotation(rep, keys, cos, sin, monkeypatch):
    """Re-positioning on torch's elementwise passes alone (what runs where the kernel does not)."""
    out = torch.full_like(keys, float("nan"))
    with monkeypatch.context() as patch:
        patch.setattr(ckernel, "rotate_keys", lambda *a: False)
        rep.rotate_into(out, keys, cos, sin)
    return out


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # phi3: partial rotary, the other dims copied
def test_the_rotation_kernel_equals_torchs_and_writes_only_its_slots(arch, dtype, monkeypatch):
    from kvrag.model.rope import Repositioner

    rep = Repositioner(tiny_model(arch))
    d = 16
    keys = torch.randn(3, 2, 700, d, generator=torch.Generator().manual_seed(7)).to(dtype)
    cos, sin = rep.angles(torch.tensor([4321]))
    cache = torch.full((3, 1, 2, 1000, d), float("nan"), dtype=dtype)  # [L, B, H_kv, capacity, D], as stitched
    assert ckernel.rotate_keys(cache[:, 0, :, 100:800], keys, cos[0], sin[0])
    got, expected = cache[:, 0, :, 100:800], _torch_rotation(rep, keys, cos[0], sin[0], monkeypatch)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
    else:  # both round one float32 result: they differ only where the sums' order moves it across a rounding
        assert (got == expected).float().mean() > 0.99
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert cache[:, :, :, :100].isnan().all() and cache[:, :, :, 800:].isnan().all()  # nothing outside its slots
    if rep.rotary_dim < d:
        assert torch.equal(cache[:, 0, :, 100:800, rep.rotary_dim :], keys[..., rep.rotary_dim :])


def test_what_the_rotation_kernel_does_not_take_is_left_to_torch():
    keys, cos = torch.randn(2, 2, 8, 16), torch.ones(16)
    out = torch.zeros_like(keys)
    assert not ckernel.rotate_keys(out, keys.half(), cos, cos)  # float16
    assert not ckernel.rotate_keys(out, keys.bfloat16(), cos, cos)  # out not of the keys' dtype
    assert not ckernel.rotate_keys(out, keys.transpose(2, 3).contiguous().transpose(2, 3), cos, cos)  # strided
    assert not ckernel.rotate_keys(out, keys, torch.ones(8, 16), torch.ones(8, 16))  # an angle a token
    assert not ckernel.rotate_keys(out.transpose(0, 1), keys.transpose(0, 1), cos, cos)  # rows unevenly spaced
    assert not out.any()  # nothing written


def _pieces(dtype, d, dv, generator):
    """A prefix (copied) and four chunks (rotated), one of a single token, as a stitch writes them."""
    prefix = [torch.randn(3, 2, 5, n, generator=generator).to(dtype) for n in (d, dv)]
    pieces, at = [(*prefix, 0, False)], 5
    for m in (40, 1, 23, 64):
        keys = torch.randn(3, 2, m, d, generator=generator).to(dtype)
        pieces.append((keys, torch.randn(3, 2, m, dv, generator=generator).to(dtype), at, True))
        at += m
    return pieces, at


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # phi3: partial rotary, the other dims copied
def test_the_one_pass_stitch_writes_what_the_rotation_and_copies_write_and_nothing_else(arch, dtype):
    from kvrag.model.rope import Repositioner

    rep = Repositioner(tiny_model(arch))
    generator = torch.Generator().manual_seed(3)
    pieces, end = _pieces(dtype, 16, 24, generator)
    cos, sin = rep.angles(torch.tensor([0, 17, 4000, 3, 250]))
    keys = torch.full((3, 2, 200, 16), float("nan"), dtype=dtype)
    values = torch.full((3, 2, 200, 24), float("nan"), dtype=dtype)
    expected_keys, expected_values = keys.clone(), values.clone()
    plan = ckernel.stitch_plan(keys, values, pieces, cos, sin)
    assert plan is not None and not plan.written
    plan.run()
    assert plan.written
    for j, (k, v, slot, rotated) in enumerate(pieces):
        m = k.shape[2]
        if rotated:
            assert ckernel.rotate_keys(expected_keys[:, :, slot : slot + m], k, cos[j], sin[j])
        else:
            expected_keys[:, :, slot : slot + m] = k
        expected_values[:, :, slot : slot + m] = v
    assert torch.equal(keys[:, :, :end], expected_keys[:, :, :end])  # bit for bit the rotation kernel's keys
    assert torch.equal(values[:, :, :end], expected_values[:, :, :end])
    assert keys[:, :, end:].isnan().all() and values[:, :, end:].isnan().all()  # the room is left as it was


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stitched_prefill_is_the_same_through_the_one_pass_kernel_and_through_torch(dtype, monkeypatch):
    from kvrag.model.encode import encode_chunks, encode_prefix
    from kvrag.model.rope import Repositioner
    from kvrag.model.recompute import recompute

    model = copy.deepcopy(tiny_model("llama")).to(dtype)  # the shared model stays as it is
    ids = torch.randint(0, 200, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    prefix = encode_prefix(model, ids[:4])
    chunks = encode_chunks(model, prefix, [ids[4:15], ids[15:21], ids[21:33]])
    rep = Repositioner(model)
    selected = {0: torch.tensor([2, 5]), 2: torch.arange(12)}  # a chunk in part, one whole, one not at all

    def prefill():
        out = recompute(model, rep, prefix, chunks, [2, 0, 1], selected, ids[33:], logits_to_keep=3, room=4)
        return out.logits, torch.stack([torch.cat([layer.keys, layer.values], -1) for layer in out.cache.layers])

    with monkeypatch.context() as patch:
        calls = []
        patch.setattr(ckernel, "stitch_plan", lambda *a, _plan=ckernel.stitch_plan: calls.append(1) or _plan(*a))
        fast = prefill()
    assert calls  # the kernel ran
    with monkeypatch.context() as patch:
        patch.setattr(ckernel, "stitch_plan", lambda *a: None)
        slow = prefill()
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_what_the_one_pass_stitch_does_not_take_is_left_to_torch():
    pieces, _ = _pieces(torch.float32, 16, 16, torch.Generator().manual_seed(0))
    cos = sin = torch.ones(len(pieces), 16)
    keys, values = torch.zeros(3, 2, 200, 16), torch.zeros(3, 2, 200, 16)
    assert ckernel.stitch_plan(keys.bfloat16(), values.bfloat16(), pieces, cos, sin) is None  # pieces not of its dtype
    halves = [(k.half(), v.half(), at, rotated) for k, v, at, rotated in pieces]
    assert ckernel.stitch_plan(keys.half(), values.half(), halves, cos, sin) is None  # float16
    assert ckernel.stitch_plan(keys[:, :, :100], values[:, :, :100], pieces, cos, sin) is None  # past the cache's slots
    assert ckernel.stitch_plan(keys, values, pieces, cos[:2], sin[:2]) is None  # an angle short
    assert ckernel.stitch_plan(keys.transpose(0, 1), values.transpose(0, 1), pieces, cos, sin) is None  # rows uneven
    strided = [(k.transpose(2, 3).contiguous().transpose(2, 3), v, s, r) for k, v, s, r in pieces]
    assert ckernel.stitch_plan(keys, values, strided, cos, sin) is None
    assert not keys.any() and not values.any()  # nothing written


def test_without_a_compiler_keys_are_rotated_by_torch(monkeypatch, tmp_path):
    from kvrag.model.rope import Repositioner

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ckernel._library.cache_clear()
    try:
        rep = Repositioner(tiny_model("llama"))
        keys = torch.randn(2, 2, 50, 16)
        cos, sin = rep.angles(torch.tensor([99]))
        assert not ckernel.rotate_keys(torch.empty_like(keys), keys, cos[0], sin[0])
        moved = rep.shift(keys, torch.full((50,), 99))  # per-token angles: torch's path in any case
        out = torch.empty_like(keys)
        rep.rotate_into(out, keys, cos[0], sin[0])
        assert torch.equal(out, moved)
    finally:
        ckernel._library.cache_clear()


needs_paged_kernel = pytest.mark.skipif(
    cpaged._paged_library() is None, reason="no C compiler with _Float16 here: the connector keeps vLLM's write"
)


def _paged_reference(keys, values, blocks, block_size, slots, transposed, cache_dtype):
    """The caches the paged write must leave: [L, blocks, H, block_size, D] keys and values, NaN where unwritten."""
    layers, heads, tokens, d = keys.shape
    k = torch.full((layers, blocks, heads, block_size, d), float("nan"), dtype=cache_dtype)
    v = torch.full_like(k, float("nan"))
    for t, slot in enumerate(slots.tolist()):
        block, at = divmod(slot, block_size)
        v[:, block, :, at] = values[:, :, t].to(cache_dtype)
        if transposed:  # a head's block as D rows of block_size slots
            k[:, block].view(layers, heads, d, block_size)[..., at] = keys[:, :, t].to(cache_dtype)
        else:
            k[:, block, :, at] = keys[:, :, t].to(cache_dtype)
    return k, v


@needs_paged_kernel
@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transposed", [True, False])
def test_the_paged_write_puts_every_token_in_its_slot_converted_and_nothing_elsewhere(source, cache_dtype, transposed):
    gen = torch.Generator().manual_seed(3)
    layers, heads, d, block_size, blocks = 3, 2, 64, 32, 6
    entry_keys = torch.randn(layers, heads, 90, d, generator=gen).to(source)
    entry_values = torch.randn(layers, heads, 90, d, generator=gen).to(source)
    keys, values = entry_keys[:, :, 10:80], entry_values[:, :, 10:80]  # a piece's tokens: a slice along T
    slots = torch.tensor([2 * block_size + 20 + t for t in range(40)] + [5 * block_size + t for t in range(30)])
    key_cache = torch.full((layers, blocks, heads, block_size, d), float("nan"), dtype=cache_dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    assert cpaged.paged_write(
        keys, values, list(key_cache), list(value_cache), slots, keys_transposed=transposed, threads=2
    )
    k, v = _paged_reference(keys, values, blocks, block_size, slots, transposed, cache_dtype)
    assert torch.equal(key_cache.isnan(), k.isnan()) and torch.equal(value_cache.isnan(), v.isnan())
    assert torch.equal(key_cache.nan_to_num(), k.nan_to_num()) and torch.equal(value_cache.nan_to_num(), v.nan_to_num())


@needs_paged_kernel
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # phi3: partial rotary, the other dims copied
def test_the_paged_write_rotates_keys_as_the_rotation_kernel_does(arch, monkeypatch):
    from kvrag.model.rope import Repositioner

    rep = Repositioner(tiny_model(arch))
    d, block_size = 16, 8
    keys = torch.randn(2, 2, 40, d, generator=torch.Generator().manual_seed(5)).half()
    values = torch.randn(2, 2, 40, d).half()
    cos, sin = rep.angles(torch.tensor([777]))
    slots = torch.arange(3, 43)
    key_cache = torch.full((2, 6, 2, block_size, d), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    assert cpaged.paged_write(
        keys, values, list(key_cache), list(value_cache), slots, keys_transposed=True, cos=cos[0], sin=sin[0]
    )
    moved = _torch_rotation(rep, keys.float(), cos[0], sin[0], monkeypatch)
    k, v = _paged_reference(moved, values, 6, block_size, slots, True, torch.float32)
    torch.testing.assert_close(key_cache, k, rtol=0, atol=2e-6, equal_nan=True)
    assert torch.equal(value_cache.nan_to_num(), v.nan_to_num())


def test_what_the_paged_write_does_not_take_it_leaves_unwritten():
    keys = torch.randn(2, 2, 8, 16)
    cache = [torch.zeros(4, 2, 8, 16) for _ in range(2)]
    slots = torch.arange(8)
    assert not cpaged.paged_write(keys, keys, cache, cache[:1], slots, keys_transposed=True)  # a layer's values
    assert not cpaged.paged_write(keys, keys.half(), cache, cache, slots, keys_transposed=True)  # mixed dtypes
    assert not cpaged.paged_write(keys, keys, cache, cache, slots.int(), keys_transposed=True)  # int32 slots
    strided = keys.transpose(2, 3)
    assert not cpaged.paged_write(strided, strided, cache, cache, slots, keys_transposed=True)
    assert not cpaged.paged_write(keys, keys, [c.double() for c in cache], cache, slots, keys_transposed=True)
    assert not cpaged.paged_write(keys, keys, cache, cache, slots, keys_transposed=True, cos=torch.ones(16))
    assert not any(c.any() for c in cache)
    with pytest.raises(IndexError, match="slots outside"):
        cpaged.paged_write(keys, keys, cache, cache, slots + 30, keys_transposed=True)


needs_bf16_kernel = pytest.mark.skipif(
    cbf16._prefill_library() is None, reason="no AVX512-BF16 CPU or no compiler: bfloat16 prefills keep torch's"
)


def _attention_reference(q, k, v, allowed):
    """float32 softmax attention of q [B, H, n, D] over k, v [B, H_kv, T, D] where `allowed` [B|1, 1, n, T]: [B, n, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = (q.float() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


@needs_bf16_kernel
@pytest.mark.parametrize("mask_kind", ["bool", "bfloat16", "float32", "causal", "none"])
@pytest.mark.parametrize(
    "batch, heads, kv_heads, n, keys, d",
    [
        (1, 9, 3, 230, 1100, 64),  # the embedded model's shape: recomputed tokens over a cache
        (2, 4, 2, 17, 100, 64),  # two prompts, a partial block of tokens and of keys
        (1, 8, 1, 33, 77, 128),
        (1, 6, 2, 5, 300, 32),
        (1, 12, 4, 40, 200, 96),
        (1, 8, 8, 130, 130, 64),  # a full prefill: n == T
    ],
)
def test_the_bfloat16_prefill_kernel_is_as_close_to_float32_attention_as_torchs(
    batch, heads, kv_heads, n, keys, d, mask_kind
):
    g = torch.Generator().manual_seed(n + keys)
    q = torch.randn(batch, n, heads, d, generator=g).bfloat16().transpose(1, 2)  # strided, as a model passes it
    k, v = (torch.randn(batch, kv_heads, keys, d, generator=g).bfloat16() for _ in range(2))
    allowed = torch.ones(batch, 1, n, keys, dtype=torch.bool)
    allowed[..., keys - n :] = torch.ones(n, n, dtype=torch.bool).tril()  # causal among the new tokens
    if mask_kind not in ("causal", "none"):
        allowed[0, 0, n - 1, : keys // 3] = False  # a hole, as a stitched prompt may have
    if mask_kind == "none":
        allowed[:] = True
    mask = {
        "bool": allowed,
        "bfloat16": torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, -3.3895e38),
        "float32": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
    }.get(mask_kind)
    got = cbf16.prefill_attention(q, k, v, mask, d**-0.5, causal=mask_kind == "causal")
    assert got is not None and got.shape == (batch, n, heads, d) and got.dtype == torch.bfloat16
    want = _attention_reference(q, k, v, allowed)
    torch_bf16 = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed, scale=d**-0.5, enable_gqa=True
    ).transpose(1, 2)
    error, torch_error = ((x.float() - want).abs().max() for x in (got, torch_bf16))
    assert error <= 1.5 * torch_error + 1e-3  # bfloat16 rounding of the output and the probabilities, no more


@needs_bf16_kernel
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (8, 1), (14, 2)])  # 8 and 7 a kv head: tiles of 3 keys
def test_scores_that_rise_block_after_block_past_the_running_max_are_as_close_as_torchs(heads, kv_heads):
    # each block of 64 keys scores higher than the one before: a little (its probabilities taken against the
    # stale max, above 1), by more than 2^8 (a block that goes the usual way), and by more than float32's range
    # (taken as they are, those probabilities would be infinite)
    g = torch.Generator().manual_seed(11)
    n, keys, d = 40, 64 * 12, 64
    u = torch.randn(d, generator=g)
    u /= u.norm()  # q . u is about 3 for every query: a key along u scores alike for all of them
    q = torch.randn(1, heads, n, d, generator=g) + 3 * u
    rise = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 40.0, 40.5, 41.0, 41.5, 400.0, 400.5, 401.0]).repeat_interleave(64)
    k = torch.randn(1, kv_heads, keys, d, generator=g) + rise[:, None] * u
    v = torch.randn(1, kv_heads, keys, d, generator=g)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    allowed = torch.ones(1, 1, n, keys, dtype=torch.bool)
    got = cbf16.prefill_attention(q, k, v, None, d**-0.5)
    want = _attention_reference(q, k, v, allowed)
    torch_bf16 = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)
    error, torch_error = ((x.float() - want).abs().max() for x in (got, torch_bf16.transpose(1, 2)))
    assert error <= 1.5 * torch_error + 1e-3


@needs_bf16_kernel
def test_the_bfloat16_prefill_kernel_refuses_what_it_does_not_compute():
    q = torch.randn(1, 4, 8, 64).bfloat16()
    k = v = torch.randn(1, 2, 20, 64).bfloat16()
    bias = torch.zeros(1, 1, 8, 20, dtype=torch.bfloat16)
    bias[0, 0, 5, 7] = -2.0  # a bias, not a mask: the caller's attention adds it
    assert cbf16.prefill_attention(q, k, v, bias, 0.125) is None
    assert cbf16.prefill_attention(q.half(), k.half(), v.half(), None, 0.125) is None
    assert cbf16.prefill_attention(q[..., :16], k[..., :16], v[..., :16], None, 0.25) is None  # head size 16
    assert cbf16.prefill_attention(torch.randn(1, 18, 8, 64).bfloat16(), k, v, None, 0.125) is None  # 9 a kv head
    assert cbf16.prefill_attention(q, k, v, bias.bool(), 0.125) is not None


@needs_bf16_kernel
@pytest.mark.parametrize(
    "value, hides",
    [
        (0.0, False),
        (-0.0, False),
        (-1.0003e30, True),  # the least bfloat16 at or above 1e30, negated
        (-3.3895e38, True),  # bfloat16's lowest
        (float("-inf"), True),
        (-9.953e29, None),  # the bfloat16 just short of -1e30: a bias, refused
        (-2.0, None),
        (1e30, None),
        (float("inf"), None),
        (float("nan"), None),
        ("-nan", None),  # a NaN with the sign bit set (bits 0xffc0)
        (1e-40, None),  # a subnormal
    ],
)
def test_a_bfloat16_mask_is_read_as_a_boolean_one_or_refused(value, hides):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 20, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 150, 64, generator=g).bfloat16() for _ in range(2))
    mask = torch.zeros(1, 1, 20, 150, dtype=torch.bfloat16)
    if value == "-nan":
        mask.view(torch.int16)[0, 0, 3:9, 40:110] = -64
    else:
        mask[0, 0, 3:9, 40:110] = value  # across a block's edge (64) and both 32-key halves of a block
    got = cbf16.prefill_attention(q, k, v, mask, 0.125)
    if hides is None:
        assert got is None
        return
    allowed = torch.ones(1, 1, 20, 150, dtype=torch.bool)
    allowed[0, 0, 3:9, 40:110] = not hides
    assert got is not None and torch.equal(got, cbf16.prefill_attention(q, k, v, allowed, 0.125))


@needs_bf16_kernel
def test_a_token_that_sees_no_key_gets_zeros_and_the_others_are_untouched():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 20, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, 90, 64, generator=g).bfloat16() for _ in range(2))
    allowed = torch.ones(1, 1, 20, 90, dtype=torch.bool)
    allowed[0, 0, 7] = False  # a padded row: it sees nothing
    got = cbf16.prefill_attention(q, k, v, allowed, 0.125)
    assert torch.equal(got[0, 7], torch.zeros(4, 64, dtype=torch.bfloat16))
    others = [i for i in range(20) if i != 7]
    want = _attention_reference(q, k, v, torch.ones_like(allowed))[:, others]
    assert (got[:, others].float() - want).abs().max() < 2e-2


def test_the_streaming_read_sums_the_buffer_and_refuses_what_it_cannot_read():
    if not ckernel.available():
        pytest.skip("no C compiler for kvrag.cpu.ckernel")
    buffer = torch.arange(64 * 100, dtype=torch.float32) % 7
    assert ckernel.stream_read(buffer) == pytest.approx(float(buffer.sum()))
    for bad in (buffer[:100], buffer.double(), buffer.view(100, 64).t()):
        with pytest.raises(ValueError, match="float32 buffer of a multiple of 64"):
            ckernel.stream_read(bad)
