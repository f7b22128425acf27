"""The C decode step over int8 weights (`csrc/decode_int8.c`, `DecodeStep.use_int8`) and over several answers' caches
side by side (`DecodeStep.rows`): close to the model's own step where it quantizes, bit for bit each answer's own
step where it batches, and refused by name where it does not take a model."""

import copy
from types import SimpleNamespace

import pytest
import torch
from tiny import FAST_DECODED, tiny_config, tiny_model

from kvrag.cpu import ckernel, int8_decoding
from kvrag.cpu.cstep import INT8_GROUP, int8_rows
from kvrag.cpu.decode import Room, decoder_of, native_decoding
from kvrag.run.recompute import full_prefill

needs_c = pytest.mark.skipif(not ckernel.available(), reason="no C compiler for kvrag.cpu.ckernel")


def _int8_here() -> bool:
    library = ckernel._library()
    return library is not None and bool(library.int8_available())


needs_int8 = pytest.mark.skipif(not _int8_here(), reason="no AVX512-VNNI: the int8 products are not built here")


def _ids(n, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_int8_rows_hold_each_group_to_half_a_step_and_the_offsets_are_the_shift_s_share():
    weight = torch.randn(40, 3 * INT8_GROUP) * torch.linspace(0.01, 3, 40)[:, None]
    weight[3, :INT8_GROUP] = 0  # a group of zeros: scale 1, values 0
    values, scales, offsets = int8_rows(weight, rows_at_once=7)  # slices that do not divide the rows
    assert values.dtype == torch.int8 and values.shape == weight.shape and scales.shape == (40, 3)
    back = values.float().view(40, 3, INT8_GROUP) * scales[..., None]
    step = scales[..., None].expand(40, 3, INT8_GROUP)
    assert ((back - weight.view(40, 3, INT8_GROUP)).abs() <= step / 2 + 1e-6).all()
    assert values.abs().max() == 127 and scales[3, 0] == 1 and not values[3, :INT8_GROUP].any()
    sums = values.float().view(40, 3, INT8_GROUP).sum(-1)
    torch.testing.assert_close(offsets, 128 * scales * sums)


def _logits(model, ids, prompt, int8):
    decoder = decoder_of(model)
    assert decoder.native.use_int8(int8) == int8
    out = full_prefill(model, ids[:prompt])
    room = Room.of(out.cache, len(ids) - prompt)
    cos, sin = decoder.rotary(prompt, len(ids) - prompt)
    return torch.stack(
        [
            decoder.native(token, cos[j], sin[j], room.keys, room.values, room.filled + j)
            for j, token in enumerate(ids[prompt:])
        ]
    )


@needs_int8
@pytest.mark.parametrize("name", FAST_DECODED)
def test_the_int8_step_is_close_to_the_model_s_own_step(name):
    """Within a few times bfloat16's own error of the float32 forward, and not the bfloat16 step itself."""
    reference_model = tiny_model(name)
    ids = _ids(50, seed=5)
    with torch.no_grad():
        reference = reference_model(torch.tensor([ids])).logits[0, 20:].float()
    model = copy.deepcopy(reference_model).to(torch.bfloat16)
    assert native_decoding(model, True)
    own, int8 = _logits(model, ids, 20, False), _logits(model, ids, 20, True)
    own_error, int8_error = (own - reference).abs().mean(), (int8 - reference).abs().mean()
    assert not torch.equal(own, int8)
    assert int8_error <= 4 * own_error, (float(int8_error), float(own_error))
    assert (int8.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.8


@needs_c
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_answers_side_by_side_are_each_answer_s_own_steps_bit_for_bit(name, int8):
    """Three answers' caches (different lengths, one over a block's edge) and one answer's token with its draft:
    every row's logits and cache slots are what that answer's own single steps give."""
    if int8 and not _int8_here():
        pytest.skip("no AVX512-VNNI: the int8 products are not built here")
    model = copy.deepcopy(tiny_model(name)).to(torch.bfloat16)
    assert native_decoding(model, True)
    decoder = decoder_of(model)
    decoder.native.use_int8(int8)
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
    decoder.native.use_int8(False)


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
def test_int8_decoding_says_why_it_does_not_take_a_model_and_the_model_s_weights_decode():
    model = _wide_model(80)  # 80 is not a multiple of the int8 group
    assert not int8_decoding(model, True)
    step = decoder_of(model).native
    assert "hidden size 80" in step.int8_takes() and not step.reads_int8
    ids = _ids(30)
    assert torch.equal(_logits(model, ids, 20, False), _logits_after_refusal(model, ids))
    other = decoder_of(_wide_model(64)).native
    other._library = SimpleNamespace(int8_available=lambda: 0)
    assert "AVX512-VNNI" in other.int8_takes() and not other.use_int8(True)


def _logits_after_refusal(model, ids):
    decoder = decoder_of(model)
    assert not decoder.native.use_int8(True)
    out = full_prefill(model, ids[:20])
    room = Room.of(out.cache, 10)
    cos, sin = decoder.rotary(20, 10)
    steps = enumerate(ids[20:])
    return torch.stack([decoder.native(t, cos[j], sin[j], room.keys, room.values, 20 + j) for j, t in steps])


@needs_int8
def test_a_kvmodel_asked_for_int8_decodes_over_int8_and_switches_back():
    from tiny import byte_tokenizer

    from kvrag import KVModel

    texts = ["alpha beta gamma delta " * 4, "one two three four " * 4]
    model = copy.deepcopy(tiny_model("qwen2")).to(torch.bfloat16)
    plain = KVModel(copy.deepcopy(model), byte_tokenizer())
    kv = KVModel(model, byte_tokenizer(), int8_decode=True)
    assert decoder_of(model).native.reads_int8

    def tokens(on):
        return on.answer("what?", on.encode(texts), strategy="full_prefill", max_new_tokens=12).token_ids

    with_int8 = tokens(kv)
    assert not int8_decoding(model, False) and not decoder_of(model).native.reads_int8
    assert tokens(kv) == tokens(plain)  # the model's own weights again: the plain model's tokens
    assert int8_decoding(model, True) and tokens(kv) == with_int8
