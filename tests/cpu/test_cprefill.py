"""A bfloat16 prefill's whole forward in one C call (`kvrag.cpu.prefill`, `kernels/prefill_layers.c`): bitwise the
model's own forward over kvrag's kernels, and only where that holds."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from kvrag.cpu import cbf16, ckernel, rotary
from kvrag.cpu.attention import use_gqa_sdpa
from kvrag.cpu.linear import use_prefill_linears
from kvrag.cpu.mlp import use_prefill_mlps
from kvrag.cpu.norm import use_prefill_norms
from kvrag.cpu.rotary import use_prefill_rotary
from kvrag.model.encode import encode_chunks, encode_prefix
from kvrag.model.rope import Repositioner
from kvrag.model.recompute import recompute

needs_kernel = pytest.mark.skipif(not cbf16.prefill_layers_available(), reason="no AVX512-BF16 CPU or no compiler")


def _kvrag_model(arch: str, head_dim: int = 32) -> torch.nn.Module:
    """A tiny bfloat16 model whose head size the prefill attention kernel takes (32; not 48), with every module kvrag
    makes on loading it (as `KVModel` does)."""
    torch.manual_seed(0)
    config = tiny_config(arch, hidden_size=128, head_dim=head_dim, intermediate_size=176, num_hidden_layers=3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(torch.bfloat16)
    use_gqa_sdpa(model)
    use_prefill_linears(model)
    use_prefill_norms(model)
    use_prefill_rotary(model)
    use_prefill_mlps(model)
    return model


def _prefill(model, selected, monkeypatch, in_c: bool, order=(2, 0, 1)):
    """A stitched prefill through `recompute`, the C forward on or off: its logits, its cache, whether C was asked
    and gave the logits (a list: one entry a call; where it did, whether it also wrote the stitch it was handed,
    a layer at a time, rather than the stitch being written in one pass), and the cache object."""
    ids = torch.randint(0, 200, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    prefix = encode_prefix(model, ids[:4])
    chunks = encode_chunks(model, prefix, [ids[4:90], ids[90:160], ids[160:280]])
    calls, passes = [], []
    with monkeypatch.context() as patch:
        run = cbf16.prefill_layers if in_c else (lambda *a: None)

        def counted(*args):
            out = run(*args)
            calls.append(out is not None)  # True: the C forward gave the logits
            return out

        patch.setattr(cbf16, "prefill_layers", counted)
        patch.setattr(ckernel.Stitch, "run", lambda self, _run=ckernel.Stitch.run: passes.append(1) or _run(self))
        out = recompute(model, Repositioner(model), prefix, chunks, list(order), selected, ids[280:], room=6)
    cache = torch.stack([torch.cat([layer.keys, layer.values], -1) for layer in out.cache.layers])
    if calls == [True]:
        calls = [True, not passes]
    return out.logits, cache, calls, out.cache


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])  # qwen3: q/k norms
@pytest.mark.parametrize(
    "selected",
    [
        {0: torch.arange(86)},  # one whole chunk recomputed, as `target_recompute` does (moved last: order 2, 0, 1)
        {0: torch.tensor([2, 5, 40]), 2: torch.arange(0, 120, 7)},  # scattered tokens: a mask with holes
        {},  # the suffix alone, as `reuse`
    ],
)
def test_the_forward_in_c_is_the_models_forward_bit_for_bit(arch, selected, monkeypatch):
    model = _kvrag_model(arch)
    want_logits, want_cache, calls, _ = _prefill(model, selected, monkeypatch, in_c=False)
    got_logits, got_cache, calls, cache = _prefill(model, selected, monkeypatch, in_c=True)
    assert calls == [True, True]  # the C forward ran, gave the logits and wrote the stitch a layer at a time
    assert torch.equal(got_logits, want_logits)
    assert torch.equal(got_cache, want_cache)  # every layer's keys and values, the new tokens' included
    assert cache.get_seq_length() == want_cache.shape[-2]


@needs_kernel
def test_what_the_forward_in_c_does_not_take_runs_the_models_forward(monkeypatch):
    selected = {0: torch.arange(86)}
    # an architecture not taken (phi3, its q, k and v one module): its forward, never the C call
    phi3 = _kvrag_model("phi3")
    logits, _, calls, _ = _prefill(phi3, selected, monkeypatch, in_c=True)
    assert not calls and logits.isfinite().all()
    model = _kvrag_model("llama")
    want, _, _, _ = _prefill(model, selected, monkeypatch, in_c=False)
    # a hook on any module: the model's forward, which calls it
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    logits, _, calls, _ = _prefill(model, selected, monkeypatch, in_c=True)
    handle.remove()
    assert not any(calls) and seen and torch.equal(logits, want)
    # a rotary handle back to transformers' function: the model's forward
    handle = model.model.layers[2].self_attn._kernel_funcs[rotary.HOOK]
    kernel_forward = handle.forward
    del handle.forward
    _, _, calls, _ = _prefill(model, selected, monkeypatch, in_c=True)
    assert not any(calls)
    handle.forward = kernel_forward
    _, _, calls, _ = _prefill(model, selected, monkeypatch, in_c=True)
    assert calls == [True, True]  # all as kvrag made it again: the C call
    # a module that is not the one kvrag made (a linear back to torch's): the model's forward
    proj = model.model.layers[0].self_attn.o_proj
    proj.__class__ = torch.nn.Linear
    _, _, calls, _ = _prefill(model, selected, monkeypatch, in_c=True)
    assert not any(calls)
    # float32: the model's forward
    logits32, _, calls, _ = _prefill(copy.deepcopy(tiny_model("llama")), selected, monkeypatch, in_c=True)
    assert not any(calls) and logits32.isfinite().all()


@needs_kernel
def test_a_c_call_refused_after_its_first_layer_leaves_the_whole_stitch_to_the_caller(monkeypatch):
    # head size 48: the C forward is asked, writes layer 0's stitch, then its attention refuses the shape; the
    # stitch is written whole and the model's forward runs: the same logits and cache as without the C call
    model = _kvrag_model("llama", head_dim=48)
    want_logits, want_cache, _, _ = _prefill(model, {0: torch.arange(86)}, monkeypatch, in_c=False)
    got_logits, got_cache, calls, _ = _prefill(model, {0: torch.arange(86)}, monkeypatch, in_c=True)
    assert calls == [False]  # asked, and it gave no logits
    assert torch.equal(got_logits, want_logits) and torch.equal(got_cache, want_cache)


@needs_kernel
def test_the_c_call_takes_positions_and_refuses_what_it_does_not_compute():
    model = _kvrag_model("llama")
    from kvrag.cpu.decode import decoder_of

    step = decoder_of(model).native
    layers, heads, d = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    assert d == 32
    keys = [torch.randn(heads, 40, d).bfloat16() for _ in range(layers)]
    values = [torch.randn(heads, 40, d).bfloat16() for _ in range(layers)]
    before = [t.clone() for t in keys + values]
    cos, sin = (torch.randn(5, d).bfloat16() for _ in range(2))
    key_positions, query_positions = torch.arange(25), torch.arange(20, 25)
    logits = cbf16.prefill_layers(step, [1, 2, 3, 4, 5], cos, sin, key_positions, query_positions, keys, values, 20)
    assert logits is not None and logits.shape == (model.config.vocab_size,) and logits.isfinite().all()
    assert all(torch.equal(a[:, :20], b[:, :20]) for a, b in zip(keys + values, before))  # the filled slots kept
    assert all(not torch.equal(a[:, 20:25], b[:, 20:25]) for a, b in zip(keys + values, before))  # the new written
    refused = [
        ([1], cos[:1], sin[:1], key_positions[:21], query_positions[:1]),  # one token: the decode step's
        ([1, 2, 3, 4, 5], cos, sin, key_positions.int(), query_positions),  # positions not int64
        ([1, 2, 3, 4, 5], cos.float(), sin.float(), key_positions, query_positions),  # rotary rows not bfloat16
        ([1, 2, 3, 4, 5], cos, sin, key_positions[:24], query_positions),  # a key without its position
        ([1, 2, 3, 4, model.config.vocab_size], cos, sin, key_positions, query_positions),  # past the vocabulary
    ]
    for tokens, c, s_, k, q in refused:
        assert cbf16.prefill_layers(step, tokens, c, s_, k, q, keys, values, 20) is None
    assert cbf16.prefill_layers(step, [1, 2, 3, 4, 5], cos, sin, torch.arange(41), torch.arange(36, 41), keys,
                                  values, 36) is None  # no room for five tokens past slot 36
