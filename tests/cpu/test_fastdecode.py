"""The fast decode step, in C (the default where it builds) and in torch, gives the transformers forward's
tokens, on every architecture it takes, and leaves the cache as that forward would; the others decode through
transformers."""

import copy
import gc
from pathlib import Path

import pytest
import torch
from tiny import ARCHS, FAST_DECODED, tiny_model

from kvrag.cpu import ckernel
from kvrag.cpu.decode import FastDecoder, Room, decoder_of, native_decoding, supports
from kvrag.run.generate import Sampling, _forward, decode
from kvrag.model.recompute import full_prefill

TAKEN = FAST_DECODED
OTHERS = [name for name in ARCHS if name not in TAKEN]


def _ids(n, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(params=["C step", "torch step"])
def step_in(request):
    """Puts a model on the C step or the torch step for the test, and the shared models back on the default."""
    native = request.param == "C step"
    if native and not ckernel.available():
        pytest.skip("no C compiler for kvrag.cpu.ckernel")
    models = []

    def on(model):
        models.append(model)
        assert native_decoding(model, native) == ckernel.available()
        return model

    yield on
    for model in models:
        native_decoding(model, True)


def _decode(model, ids, steps, fast):
    out = full_prefill(model, ids)
    sampling = Sampling(max_new_tokens=steps)
    tokens = list(decode(model, out.cache, out.logits[-1], out.next_position, sampling, eos_ids=(), fast_decoding=fast))
    return tokens, out.cache


def test_the_first_token_is_out_before_decoding_is_set_up(monkeypatch):
    """The decoder, the cache's room and the drafts' lookup serve the later tokens: the first waits for none of
    them, and a one-token answer never makes them (its cache is the prefill's, as it was)."""
    import kvrag.cpu as cpu

    model = tiny_model("llama")
    out = full_prefill(model, _ids(30))
    made = []
    monkeypatch.setattr(cpu, "decoder_of", lambda m: made.append(m) or decoder_of(m))
    steps = decode(model, out.cache, out.logits[-1], out.next_position, Sampling(max_new_tokens=3), eos_ids=(),
                   context=_ids(30))
    first = next(steps)
    assert not made  # nothing of decoding's set-up ran before the first token
    rest = list(steps)
    assert made and len(rest) == 2
    plain = full_prefill(model, _ids(30))
    alone = decode(model, plain.cache, plain.logits[-1], plain.next_position, Sampling(max_new_tokens=1), eos_ids=())
    assert list(alone) == [first] and len(made) == 1  # a one-token answer made no decoder
    assert all(layer.keys.shape[-2] == 30 for layer in plain.cache.layers)


@pytest.mark.parametrize("name", TAKEN)
def test_fast_tokens_and_cache_equal_the_transformers_forward(name, step_in):
    model = step_in(tiny_model(name))
    assert supports(model) is None
    ids = _ids(90)
    slow, slow_cache = _decode(model, ids, 40, fast=False)
    fast, fast_cache = _decode(model, ids, 40, fast=True)
    assert fast == slow and len(set(fast)) > 3  # a varied continuation, not one token repeated
    assert len(slow_cache.layers) == len(fast_cache.layers)
    for a, b in zip(slow_cache.layers, fast_cache.layers):
        assert a.keys.shape == b.keys.shape == (1, a.keys.shape[1], 90 + 39, a.keys.shape[-1])
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", TAKEN)
def test_each_step_logits_match_the_forwards(name, step_in):
    model = step_in(tiny_model(name))
    decoder = decoder_of(model)
    ids = _ids(50, seed=2)
    reference = model(torch.tensor([ids])).logits[0].float()  # [T, V] over the whole sequence at once
    out = full_prefill(model, ids[:20])
    room = Room.of(out.cache, 30)
    cos, sin = decoder.rotary(20, 30)
    for step, token in enumerate(ids[20:]):
        logits = decoder.step(token, cos[step], sin[step], room.keys, room.values, room.filled + step)
        torch.testing.assert_close(logits, reference[20 + step], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", TAKEN)
def test_the_static_step_a_cuda_graph_captures_matches_the_forwards(name):
    """`static_step` (tensor inputs, shapes fixed by the buffers, attention over every slot with the free ones
    masked) on CPU: the math that `GraphSteps` captures on CUDA, whose test needs a GPU (tests/behaviour/test_cuda.py)."""
    model = tiny_model(name)
    decoder = decoder_of(model)
    ids = _ids(50, seed=2)
    reference = model(torch.tensor([ids])).logits[0].float()
    out = full_prefill(model, ids[:20])
    room = Room.of(out.cache, 30)
    for buffers in (room.keys, room.values):  # free slots hold anything finite: masked, they weigh nothing
        for b in buffers:
            b[:, room.filled :] = torch.randn_like(b[:, room.filled :]) * 100
    cos, sin = decoder.rotary(20, 30)
    with torch.inference_mode():
        for step, token in enumerate(ids[20:]):
            token_t, slot = torch.tensor([token]), torch.tensor([room.filled + step])
            logits = decoder.static_step(token_t, cos[step], sin[step], room.keys, room.values, slot)
            torch.testing.assert_close(logits, reference[20 + step], rtol=1e-4, atol=1e-4)
    assert decoder.graphs is None  # graphs are for CUDA models only


def _storage_bytes(model):
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def test_stacking_the_weights_keeps_the_forward_bitwise_and_adds_no_copy():
    model = tiny_model("qwen2", seed=5)  # q/k/v biases are stacked too
    ids = torch.tensor([_ids(40, seed=3)])
    before = model(ids).logits.clone()
    bytes_before = _storage_bytes(model)
    FastDecoder(model)
    assert torch.equal(model(ids).logits, before)
    assert _storage_bytes(model) == bytes_before  # the modules view the stacks: no second copy
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_no_tensor_keeps_the_weights_file_mapped_once_the_decoder_copied_them(tmp_path):
    """transformers maps model.safetensors and its tensors view the mapping; the decoder copies the products' weights
    and the rest (the norms) off it, so the mapping, every page of it read at load, goes: the 1.5B was 7.4 GB resident
    with it and 4.9 without. The logits stay the same."""
    from transformers import AutoModelForCausalLM

    tiny_model("qwen2", seed=5).save_pretrained(tmp_path)
    weights = str(tmp_path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.tensor([_ids(40, seed=3)])
    with torch.no_grad():  # a graph for gradients would keep the tensors it saved, and with them the mapping
        before = model(ids).logits
    gc.collect()
    assert weights in Path("/proc/self/maps").read_text()  # mapped: what this test is about
    FastDecoder(model)
    gc.collect()
    assert weights not in Path("/proc/self/maps").read_text()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_a_split_product_equals_linear_bitwise():
    from kvrag.cpu.decode import Product

    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(40)
    for parts in (1, 2, 3, 5):  # 5 does not divide 96: one part
        assert torch.equal(Product(weight, bias, parts)(x), torch.nn.functional.linear(x, weight, bias))


@pytest.mark.parametrize("name", OTHERS)
def test_other_architectures_say_why_and_decode_through_transformers(name):
    model = tiny_model(name)
    assert supports(model) is not None and decoder_of(model) is None
    slow, _ = _decode(model, _ids(30), 8, fast=False)
    assert _decode(model, _ids(30), 8, fast=True)[0] == slow


def test_a_stopped_decode_leaves_the_fed_tokens_in_the_cache():
    model = tiny_model("llama")
    out = full_prefill(model, _ids(30))
    tokens = decode(model, out.cache, out.logits[-1], out.next_position, Sampling(max_new_tokens=20), eos_ids=())
    first = [next(tokens) for _ in range(5)]  # 4 of them fed back through the model
    tokens.close()
    assert len(first) == 5 and out.cache.layers[0].keys.shape[-2] == 30 + 4


def test_the_step_follows_the_thread_count(step_in):
    model = step_in(tiny_model("llama"))
    decoder = decoder_of(model)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        slow, _ = _decode(model, _ids(30, seed=4), 8, fast=False)
        assert _decode(model, _ids(30, seed=4), 8, fast=True)[0] == slow
        if not decoder.use_native:  # the torch step splits its products one part a thread
            assert decoder.threads == 1 and decoder.layers[0].gate_up.parts == 1
    finally:
        torch.set_num_threads(threads)


def test_weights_replaced_after_the_decoder_was_made_are_the_ones_decoded_with(step_in):
    model = step_in(tiny_model("llama", seed=7))
    ids = _ids(30, seed=5)
    _decode(model, ids, 4, fast=True)  # the decoder is made and kept
    other = tiny_model("llama", seed=8)
    model.load_state_dict({k: v.clone() for k, v in other.state_dict().items()}, assign=True)
    slow, _ = _decode(model, ids, 12, fast=False)
    assert _decode(model, ids, 12, fast=True)[0] == slow


def test_a_second_decode_continues_a_plain_cache_the_first_one_extended(step_in):
    model = step_in(tiny_model("llama"))
    ids = _ids(30, seed=6)
    out = full_prefill(model, ids)
    first = list(decode(model, out.cache, out.logits[-1], out.next_position, Sampling(max_new_tokens=5), eos_ids=()))
    fed = ids + first[:-1]  # the last token was picked, not fed
    assert out.cache.layers[0].keys.shape[-2] == len(fed)
    with torch.inference_mode():  # the last token through a transformers forward: the cache grows by a copy
        logits = _forward(model, out.cache, first[-1], len(fed))
    more = list(decode(model, out.cache, logits, len(fed) + 1, Sampling(max_new_tokens=4), eos_ids=()))
    expected, _ = _decode(model, fed + [first[-1]], 4, fast=False)
    assert more == expected


def test_a_split_product_with_a_bias_equals_linear_bitwise_in_low_precision():
    from kvrag.cpu.decode import Product

    for dtype in (torch.float32, torch.bfloat16):
        weight, bias, x = torch.randn(96, 40).to(dtype), torch.randn(96).to(dtype), torch.randn(40).to(dtype)
        assert torch.equal(Product(weight, bias, 2)(x), torch.nn.functional.linear(x, weight, bias))


@pytest.mark.skipif(not ckernel.available(), reason="no C compiler for kvrag.cpu.ckernel")
@pytest.mark.parametrize("name", TAKEN)
def test_the_c_step_in_bfloat16_is_as_close_to_float32_as_the_torch_step(name):
    """In bfloat16 the C step rounds where the torch step rounds: its logits are the torch step's up to the order
    of the sums, and no further from the float32 forward's."""
    reference_model = tiny_model(name)
    ids = _ids(60, seed=2)
    with torch.no_grad():
        reference = reference_model(torch.tensor([ids])).logits[0].float()
    logits = {}
    for native in (True, False):
        model = copy.deepcopy(reference_model).to(torch.bfloat16)
        assert native_decoding(model, native)
        decoder = decoder_of(model)
        assert (decoder.native is not None) and decoder.native.model.bf16 == 1
        out = full_prefill(model, ids[:20])
        room = Room.of(out.cache, 40)
        cos, sin = decoder.rotary(20, 40)
        logits[native] = torch.stack(
            [
                decoder.step(token, cos[step], sin[step], room.keys, room.values, room.filled + step)
                for step, token in enumerate(ids[20:])
            ]
        )
    c_error = (logits[True] - reference[20:]).abs().mean()
    torch_error = (logits[False] - reference[20:]).abs().mean()
    assert 0 < c_error <= 1.05 * torch_error  # bfloat16 costs something; the C step costs no more
    scale = reference.abs().max()
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=float(scale) * 2**-5)


@pytest.mark.skipif(not ckernel.available(), reason="no C compiler for kvrag.cpu.ckernel")
def test_the_c_step_runs_where_it_takes_the_cache_and_the_torch_step_elsewhere(monkeypatch):
    model = tiny_model("qwen2")
    decoder = decoder_of(model)
    assert decoder.native is not None and decoder.use_native
    native = decoder.native

    class Counted:
        calls = 0

        def takes(self, *args):
            return native.takes(*args)

        def __call__(self, *args):
            self.calls += 1
            return native(*args)

    counted = Counted()
    monkeypatch.setattr(decoder, "native", counted)
    slow, _ = _decode(model, _ids(30, seed=9), 6, fast=False)
    assert _decode(model, _ids(30, seed=9), 6, fast=True)[0] == slow and counted.calls == 5
    out = full_prefill(model, _ids(30, seed=9))
    room = Room.of(out.cache, 4)
    cos, sin = decoder.rotary(30, 4)
    half = [k.half() for k in room.keys]  # a cache in another dtype than the weights': the torch step's
    assert not native.takes(cos[0], half, [v.half() for v in room.values])
    assert not native.takes(cos[0].float().half(), room.keys, room.values)
    with pytest.raises(ValueError, match="slot 34 of 34"):
        native(5, cos[0], sin[0], room.keys, room.values, 34)


def test_the_c_step_is_not_made_where_the_kernels_did_not_build(monkeypatch):
    monkeypatch.setattr(ckernel, "_library", lambda: None)
    model = copy.deepcopy(tiny_model("llama"))
    decoder = decoder_of(model)
    assert decoder is not None and decoder.native is None
    assert not native_decoding(model, True)
    slow, _ = _decode(model, _ids(30), 6, fast=False)
    assert _decode(model, _ids(30), 6, fast=True)[0] == slow


def _odd_model():
    """A llama whose products have tails past their 32-lane bodies (hidden 80, ffn 144, head_dim 16)."""
    from tiny import tiny_config
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads = 80, 144, 5, 1
    config.head_dim = 16
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


@pytest.mark.skipif(not ckernel.available(), reason="no C compiler for kvrag.cpu.ckernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [*TAKEN, "odd shapes"])
def test_a_step_of_several_tokens_is_those_single_steps_bit_for_bit(name, dtype):
    """K tokens in one pass over the weights: each one's logits and cache slot are what K steps of one token
    give, exactly, for every K the C step takes, over attention blocks' edges (256 slots)."""
    model = copy.deepcopy(_odd_model() if name == "odd shapes" else tiny_model(name)).to(dtype)
    assert native_decoding(model, True)
    decoder = decoder_of(model)
    ids = _ids(260, seed=4)
    for filled_at, count in [(20, 1), (20, 2), (40, 5), (250, ckernel.MAX_TOKENS), (200, 3)]:
        out = full_prefill(model, ids[:filled_at])
        single, several = Room.of(out.cache, 12), Room.of(copy.deepcopy(out.cache), 12)
        cos, sin = decoder.rotary(filled_at, count)
        tokens = ids[filled_at : filled_at + count]
        one_by_one = torch.stack(
            [
                decoder.native(token, cos[j], sin[j], single.keys, single.values, single.filled + j)
                for j, token in enumerate(tokens)
            ]
        )
        at_once = decoder.native.steps(tokens, cos, sin, several.keys, several.values, several.filled)
        assert at_once.shape == (count, model.config.vocab_size)
        assert torch.equal(at_once, one_by_one), f"{count} tokens from slot {filled_at}"
        end = single.filled + count
        for a, b in zip([*single.keys, *single.values], [*several.keys, *several.values]):
            assert torch.equal(a[:, :end], b[:, :end])
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        decoder.native.steps(ids[:9], *decoder.rotary(0, 9), single.keys, single.values, 0)
