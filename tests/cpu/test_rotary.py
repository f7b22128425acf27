"""The bfloat16 prefill rotary kernel (`kvrag.cpu.cbf16.prefill_rotary`) and the attention handles that use it
(`kvrag.cpu.rotary`)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from tiny import ARCHS, VOCAB, tiny_config
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvrag.cpu import cbf16
from kvrag.cpu.rotary import HOOK, use_prefill_rotary

needs_kernel = pytest.mark.skipif(not cbf16.prefill_linear_available(), reason="no AVX512-BF16 CPU or no compiler")


def _rows(batch, heads, kv_heads, n, d, shared, seed):
    g = torch.Generator().manual_seed(seed)
    q = (4 * torch.randn(batch, n, heads, d, generator=g)).bfloat16().transpose(1, 2)  # as the projections give it
    k = (4 * torch.randn(batch, n, kv_heads, d, generator=g)).bfloat16().transpose(1, 2)
    angles = torch.arange(n, dtype=torch.float)[:, None] * torch.rand(d // 2, generator=g) * 40
    emb = torch.cat((angles, angles), -1)[None].expand(1 if shared else batch, n, d)
    return q, k, emb.cos().bfloat16(), emb.sin().bfloat16()


@needs_kernel
@pytest.mark.parametrize(
    "batch, heads, kv_heads, n, d, shared",
    [(1, 9, 3, 174, 64, False), (2, 4, 2, 17, 128, False), (2, 4, 2, 9, 64, True), (1, 6, 2, 5, 18, False)],
)
def test_the_kernel_is_bitwise_transformers_rotation(batch, heads, kv_heads, n, d, shared):
    q, k, cos, sin = _rows(batch, heads, kv_heads, n, d, shared, seed=n + d)
    got = cbf16.prefill_rotary(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    assert got is not None and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[0].shape == q.shape and got[0].stride() == want[0].stride()  # laid out as transformers lays it


def test_what_the_rotary_kernel_does_not_take_is_left_to_transformers():
    q, k, cos, sin = _rows(1, 4, 2, 6, 32, False, seed=1)
    assert cbf16.prefill_rotary(q.float(), k.float(), cos.float(), sin.float()) is None  # float32
    assert cbf16.prefill_rotary(q[:, :, :1], k[:, :, :1], cos[:, :1], sin[:, :1]) is None  # one token: decoding
    assert cbf16.prefill_rotary(q[..., ::2], k[..., ::2], cos[..., :16], sin[..., :16]) is None  # strided rows
    assert cbf16.prefill_rotary(q, k, cos[..., :16], sin[..., :16]) is None  # a partial rotation


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma", "llama_yarn"])
def test_a_bfloat16_model_rotates_in_the_kernel_and_its_logits_are_bitwise_the_same(arch, monkeypatch):
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa").eval()
    plain = plain.to(torch.bfloat16)
    fast = copy.deepcopy(plain)
    layers = fast.config.num_hidden_layers
    assert use_prefill_rotary(fast) == layers
    calls = []
    kernel = cbf16.prefill_rotary
    monkeypatch.setattr(cbf16, "prefill_rotary", lambda *a: calls.append(1) or kernel(*a))
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = plain(input_ids=ids).logits, fast(input_ids=ids).logits
    assert len(calls) == layers and torch.equal(got, want)
    calls.clear()
    fast(input_ids=ids).logits.sum().backward()  # autograd on: transformers' own function
    assert not calls and fast.model.embed_tokens.weight.grad is not None
    again = pickle.loads(pickle.dumps(fast))  # a model saved whole loads again (its handles as transformers makes them)
    with torch.inference_mode():
        assert torch.equal(again(input_ids=ids).logits, want)


def test_float32_models_and_handles_that_compute_something_else_are_left_as_they_are():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    assert use_prefill_rotary(model) == 0  # float32
    model = model.to(torch.bfloat16)
    handle = model.model.layers[0].self_attn.__dict__["_kernel_funcs"][HOOK]

    class Doubled(type(handle)):  # another rotation (as a model with its own function would have)
        def forward(self, q, k, cos, sin, unsqueeze_dim=1):
            return q * 2, k * 2

    for layer in model.model.layers:
        layer.self_attn.__dict__["_kernel_funcs"][HOOK] = Doubled()
    if cbf16.prefill_linear_available():
        assert use_prefill_rotary(model) == 0
    handles = [layer.self_attn.__dict__["_kernel_funcs"][HOOK] for layer in model.model.layers]
    assert all("forward" not in h.__dict__ for h in handles)


@pytest.mark.skipif("gpt_neox" not in ARCHS, reason="no partial-rotation architecture among the tiny models")
def test_a_partial_rotation_keeps_transformers_function():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gpt_neox"), attn_implementation="sdpa").eval()
    model = model.to(torch.bfloat16)
    plain = copy.deepcopy(model)
    use_prefill_rotary(model)  # whatever it takes, the logits stay transformers'
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
