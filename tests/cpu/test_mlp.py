"""The bfloat16 prefill SiLU-and-product kernel (`kvrag.cpu.cbf16.prefill_silu_mul`) and the MLPs that use it
(`kvrag.cpu.mlp`)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from tiny import VOCAB, tiny_config
from transformers import AutoModelForCausalLM

from kvrag.cpu import cbf16
from kvrag.cpu.decode import supports
from kvrag.cpu.mlp import use_prefill_mlps

needs_kernel = pytest.mark.skipif(not cbf16.prefill_linear_available(), reason="no AVX512-BF16 CPU or no compiler")


@needs_kernel
@pytest.mark.parametrize("tokens, width", [(2, 16), (175, 1536), (33, 100), (64, 130)])
def test_the_kernel_rounds_where_torch_rounds(tokens, width):
    g = torch.Generator().manual_seed(tokens + width)
    gate = (4 * torch.randn(1, tokens, width, generator=g)).bfloat16()
    gate[0, 0, :4] = torch.tensor([-120.0, -90.0, 90.0, 0.0])  # exp's limits: SiLU -0, -0, the gate itself, 0
    up = (2 * torch.randn(1, tokens, width, generator=g)).bfloat16()
    with torch.inference_mode():
        want, got = F.silu(gate) * up, cbf16.prefill_silu_mul(gate, up)
    assert got is not None and got.shape == want.shape and got.dtype == torch.bfloat16
    # the same roundings; only the exp is another one within an ulp: one bfloat16 step apart at most, rarely
    step = want.float().abs() * 2**-7 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() >= 0.999
    assert torch.equal(got[0, 0, :4], want[0, 0, :4])


def test_what_the_silu_kernel_does_not_take_goes_back_to_the_module():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert cbf16.prefill_silu_mul(x.float(), x.float()) is None  # float32
    assert cbf16.prefill_silu_mul(x[:1], x[:1]) is None  # one token
    assert cbf16.prefill_silu_mul(x, x[:, :4]) is None  # shapes that differ


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_bfloat16_model_runs_its_mlps_in_the_kernel_as_close_to_float32_as_torch(arch, monkeypatch):
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa").eval()
    plain = copy.deepcopy(reference).to(torch.bfloat16)
    fast = copy.deepcopy(plain)
    layers = fast.config.num_hidden_layers
    assert use_prefill_mlps(fast) == layers
    assert all(type(layer.mlp).__name__.startswith("Prefill") for layer in fast.model.layers)
    assert supports(fast) is None and fast.state_dict().keys() == plain.state_dict().keys()
    calls = []
    kernel = cbf16.prefill_silu_mul

    def counted(gate, up):
        out = kernel(gate, up)
        calls.extend([] if out is None else [gate.shape])
        return out

    monkeypatch.setattr(cbf16, "prefill_silu_mul", counted)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = reference(input_ids=ids).logits
        torch_bf16 = plain(input_ids=ids).logits.float()
        got = fast(input_ids=ids).logits.float()
        one = fast(input_ids=ids[:, :1]).logits  # one token: the module's own arithmetic
    assert len(calls) == layers
    assert (got - want).abs().mean() <= 1.1 * (torch_bf16 - want).abs().mean()
    with torch.inference_mode():
        assert torch.equal(one, plain(input_ids=ids[:, :1]).logits)
    calls.clear()
    fast(input_ids=ids).logits.sum().backward()  # autograd on: the module's own forward
    assert fast.model.layers[0].mlp.gate_proj.weight.grad is not None and not calls
    again = pickle.loads(pickle.dumps(fast.model.layers[0].mlp))  # a model saved whole finds the class by name
    assert type(again) is type(fast.model.layers[0].mlp)


def test_float32_and_other_mlps_are_left_as_they_are():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    assert use_prefill_mlps(model) == 0  # float32
    gelu = AutoModelForCausalLM.from_config(tiny_config("llama", hidden_act="gelu"), attn_implementation="sdpa")
    assert use_prefill_mlps(gelu.to(torch.bfloat16)) == 0  # another activation: not the kernel's arithmetic
    model = model.to(torch.bfloat16)
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a hooked module: left as it is
    taken = use_prefill_mlps(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    if cbf16.prefill_linear_available():
        assert taken == model.config.num_hidden_layers - 1
