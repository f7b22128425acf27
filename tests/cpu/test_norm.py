"""The bfloat16 prefill RMSNorm kernel (`kvrag.cpu.cbf16.prefill_rms_norm`) and the norms that use it
(`kvrag.cpu.norm`)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from tiny import VOCAB, tiny_config
from transformers import AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kvrag.cpu import cbf16
from kvrag.cpu.decode import supports
from kvrag.cpu.norm import is_prefill_norm, use_prefill_norms

needs_kernel = pytest.mark.skipif(not cbf16.prefill_linear_available(), reason="no AVX512-BF16 CPU or no compiler")


@needs_kernel
@pytest.mark.parametrize("tokens, dim", [(2, 16), (175, 576), (33, 100), (64, 128)])
def test_the_kernel_rounds_where_the_module_rounds(tokens, dim):
    g = torch.Generator().manual_seed(tokens + dim)
    norm = LlamaRMSNorm(dim, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = torch.randn(dim, generator=g).to(torch.bfloat16)
    x = (3 * torch.randn(1, tokens, dim, generator=g)).to(torch.bfloat16)
    with torch.inference_mode():
        want, got = norm(x), cbf16.prefill_rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got is not None and got.shape == want.shape and got.dtype == torch.bfloat16
    # the same roundings; only the mean's sum runs in another order: one bfloat16 step apart at most, rarely
    step = want.float().abs() * 2**-7 + 1e-30
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() >= 0.999


def test_what_the_norm_kernel_does_not_take_goes_back_to_the_module():
    w = torch.ones(8, dtype=torch.bfloat16)
    assert cbf16.prefill_rms_norm(torch.randn(4, 8), w.float(), 1e-6) is None  # float32
    assert cbf16.prefill_rms_norm(torch.randn(1, 8, dtype=torch.bfloat16), w, 1e-6) is None  # one token
    assert cbf16.prefill_rms_norm(torch.randn(4, 16, dtype=torch.bfloat16)[:, ::2], w, 1e-6) is None  # strided


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: norms of the queries' and keys' heads too
def test_a_bfloat16_model_runs_its_norms_in_the_kernel_as_close_to_float32_as_torch(arch, monkeypatch):
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config(arch), attn_implementation="sdpa").eval()
    plain = copy.deepcopy(reference).to(torch.bfloat16)
    fast = copy.deepcopy(plain)
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in fast.modules())
    assert use_prefill_norms(fast) == norms > 0
    assert all(is_prefill_norm(m) for m in fast.modules() if "RMSNorm" in type(m).__name__)
    assert supports(fast) is None and fast.state_dict().keys() == plain.state_dict().keys()
    calls = []
    kernel = cbf16.prefill_rms_norm
    monkeypatch.setattr(cbf16, "prefill_rms_norm", lambda *a: calls.append(1) or kernel(*a))
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = reference(input_ids=ids).logits
        torch_bf16 = plain(input_ids=ids).logits.float()
        got = fast(input_ids=ids).logits.float()
    assert len(calls) == norms
    assert (got - want).abs().mean() <= 1.1 * (torch_bf16 - want).abs().mean()
    calls.clear()
    fast(input_ids=ids).logits.sum().backward()  # autograd on: the module's own forward
    assert fast.model.norm.weight.grad is not None and not calls
    again = pickle.loads(pickle.dumps(fast.model.norm))  # a model saved whole finds the class by name
    assert type(again) is type(fast.model.norm) and torch.equal(again.weight, fast.model.norm.weight)


def test_float32_and_other_norms_are_left_as_they_are():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    assert use_prefill_norms(model) == 0  # float32
    model = model.to(torch.bfloat16)

    class OffsetNorm(LlamaRMSNorm):  # another forward (as Gemma's 1 + weight): not the kernel's arithmetic
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1

    model.model.norm.__class__ = OffsetNorm
    llama = sum(type(m) is LlamaRMSNorm for m in model.modules())
    swapped = use_prefill_norms(model)
    assert type(model.model.norm) is OffsetNorm
    assert llama > 0 and swapped == (llama if cbf16.prefill_linear_available() else 0)


def test_a_norm_whose_source_cannot_be_read_is_left_as_it_is(monkeypatch):
    import inspect

    from kvrag.cpu import norm

    monkeypatch.setattr(inspect, "getsource", lambda obj: (_ for _ in ()).throw(OSError("could not get source code")))
    assert norm.prefill_class.__wrapped__("LlamaRMSNorm") is None  # uncached: the classes made so far stay
