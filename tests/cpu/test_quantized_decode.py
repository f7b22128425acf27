"""The C decode step over int8 and int4 weights (`csrc/decode_quantized.c`, `DecodeStep.quantize`) and over several
answers' caches side by side (`DecodeStep.rows`): close to the model's own step where it quantizes, bit for bit each
answer's own step where it batches, and refused by name where it does not take a model."""

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from tiny import FAST_DECODED, tiny_config, tiny_model

from kvrag.cpu import ckernel, decode_weights
from kvrag.cpu.cstep import INT8_GROUP, int4_rows, int4_rows_torch, int8_rows, int8_rows_torch
from kvrag.cpu.decode import Room, decoder_of, native_decoding
from kvrag.model.recompute import full_prefill

needs_c = pytest.mark.skipif(not ckernel.available(), reason="no C compiler for kvrag.cpu.ckernel")


def _bits_here(bits: int) -> bool:
    library = ckernel._library()
    return library is not None and bool(library.int8_available() if bits == 8 else library.int4_available())


needs_int8 = pytest.mark.skipif(not _bits_here(8), reason="no AVX512-VNNI, no AVX2: the int8 products are not built")
needs_int4 = pytest.mark.skipif(not _bits_here(4), reason="no AVX512-VNNI, no AVX2: the int4 products are not built")
BITS = [pytest.param(8, marks=needs_int8), pytest.param(4, marks=needs_int4)]


@functools.lru_cache(maxsize=None)
def _model(name, bits):
    """The tiny model of `name` (float32), widened where int4 needs 128 columns a product (hidden 128, ffn 256, 8
    heads of 16)."""
    if bits != 4:
        return tiny_model(name)
    from transformers import AutoModelForCausalLM

    config = tiny_config(name, hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                         initializer_range=0.2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


def _ids(n, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_int8_rows_hold_each_group_to_half_a_step_and_the_offsets_are_the_shift_s_share():
    weight = torch.randn(40, 3 * INT8_GROUP) * torch.linspace(0.01, 3, 40)[:, None]
    weight[3, :INT8_GROUP] = 0  # a group of zeros: scale 1, values 0
    values, scales, offsets = int8_rows_torch(weight, rows_at_once=7)  # slices that do not divide the rows
    assert values.dtype == torch.int8 and values.shape == weight.shape and scales.shape == (40, 3)
    back = values.float().view(40, 3, INT8_GROUP) * scales[..., None]
    step = scales[..., None].expand(40, 3, INT8_GROUP)
    assert ((back - weight.view(40, 3, INT8_GROUP)).abs() <= step / 2 + 1e-6).all()
    assert values.abs().max() == 127 and scales[3, 0] == 1 and not values[3, :INT8_GROUP].any()
    sums = values.float().view(40, 3, INT8_GROUP).sum(-1)
    torch.testing.assert_close(offsets, 128 * scales * sums)


def _logits(model, ids, prompt, bits, out=None):
    """The C step's logits of ids[prompt:] one by one over `bits`-bit weights (None: the model's own), after the
    model's prefill of ids[:prompt] (or over a copy of `out`, a prefill made before)."""
    decoder = decoder_of(model)
    assert decoder.native.quantize(bits) == (bits is not None)
    out = full_prefill(model, ids[:prompt]) if out is None else copy.deepcopy(out)
    room = Room.of(out.cache, len(ids) - prompt)
    cos, sin = decoder.rotary(prompt, len(ids) - prompt)
    return torch.stack(
        [
            decoder.native(token, cos[j], sin[j], room.keys, room.values, room.filled + j)
            for j, token in enumerate(ids[prompt:])
        ]
    )


def test_int4_rows_hold_each_group_to_half_a_level_and_pack_two_a_byte():
    weight = torch.randn(24, 256) * torch.linspace(0.01, 3, 24)[:, None]
    weight[5, 64:128] = 0.25  # a group of one value: scale 1, every level 0
    values, scales, minimums = int4_rows_torch(weight, rows_at_once=5)
    assert values.dtype == torch.uint8 and values.shape == (24, 128) and scales.dtype == minimums.dtype == torch.float16
    low, high = (values & 15).view(24, 2, 64), (values >> 4).view(24, 2, 64)
    levels = torch.stack([low, high], dim=2).view(24, 256)  # each 128: the low halves, then the high halves
    back = levels.float().view(24, 4, 64) * scales.float()[..., None] + minimums.float()[..., None]
    step = scales.float()[..., None].expand(24, 4, 64)
    assert ((back - weight.view(24, 4, 64)).abs() <= step / 2 + 2e-3 * weight.abs().amax()).all()
    assert scales[5, 1] == 1 and not levels[5, 64:128].any() and levels.max() == 15



@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_quantizer_makes_the_torch_reference_s_bits(dtype):
    """`int8_rows` and `int4_rows` quantize in C (`csrc/quantize_weights.c`): the torch reference's values, scales
    and offsets or minimums bit for bit, over magnitudes from float16's subnormals to past its largest value, a group
    of zeros and one of a single value."""
    weight = torch.randn(300, 512, generator=torch.Generator().manual_seed(3)) * torch.logspace(-7, 4, 300)[:, None]
    weight[3, :64], weight[4, 64:128], weight[5, 128:256] = 0, 0.25, 7e4
    weight = weight.to(dtype)
    from kvrag.cpu.cstep import _quantized_in_c

    for bits, reference in ((8, int8_rows_torch(weight)), (4, int4_rows_torch(weight))):
        made = _quantized_in_c(weight, bits)
        assert made is not None and len(made) == len(reference) == 3
        for got, want in zip(made, reference):
            assert got.dtype == want.dtype and torch.equal(got, want)
    assert int8_rows(weight)[0].abs().max() == 127 and int4_rows(weight)[0].max() > 15  # both halves of a byte used


def _dequantized(weight, bits):
    """What the `bits`-bit copy of `weight` holds, as float32."""
    rows, columns = weight.shape
    if bits == 8:
        values, scales, _ = int8_rows(weight)
        return (values.float().view(rows, -1, INT8_GROUP) * scales[..., None]).view(rows, columns)
    values, scales, minimums = int4_rows(weight)
    low, high = (values & 15).view(rows, -1, 64), (values >> 4).view(rows, -1, 64)
    levels = torch.stack([low, high], dim=2).view(rows, columns).float().view(rows, -1, INT8_GROUP)
    return (levels * scales.float()[..., None] + minimums.float()[..., None]).view(rows, columns)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("name", FAST_DECODED)
def test_the_quantized_step_computes_with_its_quantized_weights(name, bits):
    """The C step over `bits`-bit weights against the model's own step over those weights de-quantized (bfloat16):
    what is left is the inputs' quantization and the order of the sums, within a few times what bfloat16 itself
    costs against float32; and it is not the model's own step (the weights were quantized)."""
    reference_model = _model(name, bits)
    ids = _ids(50, seed=5)
    with torch.no_grad():
        reference = reference_model(torch.tensor([ids])).logits[0, 20:].float()
    model = copy.deepcopy(reference_model).to(torch.bfloat16)
    assert native_decoding(model, True)
    prefilled = full_prefill(model, ids[:20])  # the prompt's KV from the model's own weights, for both steps
    own, quantized = _logits(model, ids, 20, None, prefilled), _logits(model, ids, 20, bits, prefilled)
    decoder = decoder_of(model)
    weights = [decoder.lm_head.weight] + [getattr(layer, n).weight for layer in decoder.layers
                                          for n in ("qkv", "o", "gate_up", "down")]
    with torch.no_grad():
        for weight in weights:  # the model's own weights become what the quantized copies hold
            weight.copy_(_dequantized(weight, bits).to(weight.dtype))
    same_weights = _logits(model, ids, 20, None, prefilled)
    bf16_error = (own - reference).abs().mean()
    assert (quantized - same_weights).abs().mean() <= 4 * bf16_error
    assert not torch.equal(own, quantized)


@pytest.mark.parametrize("bits", BITS)
def test_a_quantized_product_is_the_sum_over_its_quantized_weights_and_inputs(bits):
    """One product in C against the same sum in float64 over the de-quantized weights and the inputs quantized as
    the kernel quantizes them (per 64, largest magnitude 127): equal to float32 rounding, for 1 to 8 inputs."""
    import ctypes

    library = ckernel._library()
    rows, columns = 100, 384
    weight = torch.randn(rows, columns, generator=torch.Generator().manual_seed(2))
    if bits == 8:
        values, scales, offsets = int8_rows(weight)
        function = library.product_int8
    else:
        values, scales, offsets = int4_rows(weight)
        function = library.product_int4
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    function.restype = ctypes.c_int
    kept = _dequantized(weight, bits).double()
    for count in (1, 3, 8):
        x = torch.randn(count, columns, generator=torch.Generator().manual_seed(count))
        step = x.view(count, -1, INT8_GROUP).abs().amax(-1, keepdim=True) / 127
        xq = ((x.view(count, -1, INT8_GROUP) / step).round() * step).view(count, columns).double()
        sums, scratch = torch.empty(count, rows), torch.empty(count * columns)
        status = function(values.data_ptr(), scales.data_ptr(), offsets.data_ptr(), x.data_ptr(), sums.data_ptr(),
                          rows, columns, count, scratch.data_ptr(), 2)
        assert status == 0
        torch.testing.assert_close(sums.double(), xq @ kept.T, rtol=1e-5, atol=1e-3)


@needs_c
@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_answers_side_by_side_are_each_answer_s_own_steps_bit_for_bit(name, bits):
    """Three answers' caches (different lengths, one over a block's edge) and one answer's token with its draft:
    every row's logits and cache slots are what that answer's own single steps give."""
    if bits and not _bits_here(bits):
        pytest.skip(f"the int{bits} products are not built on this CPU")
    model = copy.deepcopy(_model(name, bits)).to(torch.bfloat16)
    assert native_decoding(model, True)
    decoder = decoder_of(model)
    assert decoder.native.quantize(bits) == (bits is not None)
    ids = _ids(300, seed=6)
    lengths = [20, 255, 41]
    alone, together = [], []
    for length in lengths:
        out = full_prefill(model, ids[:length])
        alone.append(Room.of(out.cache, 8))
        together.append(Room.of(copy.deepcopy(out.cache), 8))
    rows = [(0, 0), (1, 0), (2, 0), (2, 1)]  # (answer, step): answer 2 feeds a token and its draft
    tokens = [ids[lengths[a] + s] for a, s in rows]
    rotary = [decoder.rotary(lengths[a] + s, 1) for a, s in rows]
    cos, sin = torch.cat([c for c, _ in rotary]), torch.cat([s for _, s in rotary])
    caches = [(together[a].keys, together[a].values) for a, _ in rows]
    logits = decoder.native.rows(tokens, cos, sin, caches, [lengths[a] + s for a, s in rows])
    for j, (a, s) in enumerate(rows):
        own = decoder.native(tokens[j], cos[j], sin[j], alone[a].keys, alone[a].values, lengths[a] + s)
        assert torch.equal(logits[j], own), f"row {j}"
    for a, length in enumerate(lengths):
        end = length + (2 if a == 2 else 1)
        for x, y in zip([*alone[a].keys, *alone[a].values], [*together[a].keys, *together[a].values]):
            assert torch.equal(x[:, :end], y[:, :end])
    with pytest.raises(ValueError, match="as many of each"):
        decoder.native.rows(tokens, cos, sin, caches[:2], [0, 0, 0, 0])
    decoder.native.quantize(None)


def _wide_model(hidden):
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads = (
        hidden, 128, hidden // 16, 1
    )
    config.head_dim = 16
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).eval()


@needs_c
def test_quantized_decoding_says_why_it_does_not_take_a_model_and_the_model_s_weights_decode():
    model = _wide_model(80)  # 80 is not a multiple of the int8 group
    assert not decode_weights(model, "int8")
    step = decoder_of(model).native
    assert "hidden size 80" in step.quantized_takes(8) and step.reads_bits is None
    ids = _ids(30)
    assert torch.equal(_logits(model, ids, 20, None), _logits_after_refusal(model, ids))
    wide = _wide_model(64)  # int8 takes it; int4 reads 128 columns at a time
    assert "hidden size 64, heads x head_dim 64 not a multiple of 128" == decoder_of(wide).native.quantized_takes(4)
    other = decoder_of(wide).native
    other._library = SimpleNamespace(int8_available=lambda: 0, int4_available=lambda: 0)
    assert "AVX512-VNNI" in other.quantized_takes(8) and not other.quantize(8)
    four = decoder_of(_wide_model(128)).native  # widths int4 takes, on a CPU without its products
    four._library = SimpleNamespace(int8_available=lambda: 0, int4_available=lambda: 0)
    assert "AVX2" in four.quantized_takes(4) and not four.quantize(4)
    with pytest.raises(ValueError, match="int8, int4"):
        decode_weights(model, "int2")


def _logits_after_refusal(model, ids):
    decoder = decoder_of(model)
    assert not decoder.native.quantize(8)
    out = full_prefill(model, ids[:20])
    room = Room.of(out.cache, 10)
    cos, sin = decoder.rotary(20, 10)
    steps = enumerate(ids[20:])
    return torch.stack([decoder.native(t, cos[j], sin[j], room.keys, room.values, 20 + j) for j, t in steps])


@needs_int8
def test_a_kvmodel_asked_for_quantized_weights_decodes_over_them_and_switches_back():
    from tiny import byte_tokenizer

    from kvrag import KVModel

    texts = ["alpha beta gamma delta " * 4, "one two three four " * 4]
    model = copy.deepcopy(_model("qwen2", 4)).to(torch.bfloat16)
    plain = KVModel(copy.deepcopy(model), byte_tokenizer())
    kv = KVModel(model, byte_tokenizer(), decode_weights="int8")
    assert decoder_of(model).native.reads_bits == 8

    def tokens(on):
        return on.answer("what?", on.encode(texts), strategy="full_prefill", max_new_tokens=12).token_ids

    with_int8 = tokens(kv)
    assert decode_weights(model, "int4") and decoder_of(model).native.reads_bits == 4
    with_int4 = tokens(kv)
    assert decode_weights(model, "model") and decoder_of(model).native.reads_bits is None
    assert tokens(kv) == tokens(plain)  # the model's own weights again: the plain model's tokens
    assert decode_weights(model, "int8") and tokens(kv) == with_int8
    assert decode_weights(model, "int4") and tokens(kv) == with_int4
    with pytest.warns(RuntimeWarning, match="decodes over its own weights"):
        KVModel(_wide_model(80), byte_tokenizer(), decode_weights="int4")
