"""The bfloat16 prefill linear kernel (`kvrag.cpu.cbf16.prefill_linear`) and the modules that use it
(`kvrag.cpu.linear`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny import VOCAB, tiny_config
from transformers import AutoModelForCausalLM

from kvrag.cpu import cbf16
from kvrag.cpu.decode import supports
from kvrag.cpu.linear import PrefillLinear, use_prefill_linears

needs_kernel = pytest.mark.skipif(not cbf16.prefill_linear_available(), reason="no AVX512-BF16 CPU or no compiler")


def _error(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    exact = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    return (out.double() - exact).abs().mean().item()


@needs_kernel
@pytest.mark.parametrize(
    "m, n, k",
    [(2, 8, 2), (17, 13, 64), (50, 192, 576), (175, 576, 1536), (300, 40, 96), (1, 8, 2), (1, 1539, 576), (1, 70, 18)],
)
@pytest.mark.parametrize("biased", [False, True])
def test_the_kernel_is_as_close_to_the_exact_product_as_torch(m, n, k, biased):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(1, m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if biased else None
    got = cbf16.prefill_linear(x, w, b)
    want = F.linear(x, w, b)
    assert got is not None and got.shape == want.shape == (1, m, n) and got.dtype == torch.bfloat16
    # bfloat16 rounding of float32 sums: within a step of each output, and on average no further than torch's
    assert torch.allclose(got.float(), want.float(), rtol=2**-7, atol=2**-7 * want.float().abs().max().item())
    assert _error(got[0], x[0], w, b) <= 1.05 * _error(want[0], x[0], w, b) + 1e-6


@needs_kernel
def test_a_tokens_outputs_are_bitwise_the_same_whatever_the_other_tokens():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 576, generator=g).to(torch.bfloat16)
    w = (torch.randn(200, 576, generator=g) / 24).to(torch.bfloat16)
    whole = cbf16.prefill_linear(x, w, None)
    for start, stop in [(0, 2), (3, 20), (47, 49), (50, 130), (101, 200)]:
        assert torch.equal(cbf16.prefill_linear(x[start:stop], w, None), whole[start:stop])
    # torch's own product gives no such promise; the kernel does (a chunk encoded alone, then in a full prefill)
    shuffled = torch.randperm(200, generator=g)
    assert torch.equal(cbf16.prefill_linear(x[shuffled], w, None), whole[shuffled])
    # one token alone (its own product, a prefill's last token through the output head): the same sums
    for i in (0, 57, 199):
        assert torch.equal(cbf16.prefill_linear(x[i : i + 1], w, None), whole[i : i + 1])
    short, rows, bias = x[:5, :18], w[:70, :18].contiguous(), torch.randn(70, generator=g).to(torch.bfloat16)  # partial blocks
    together = cbf16.prefill_linear(short, rows, bias)
    assert all(torch.equal(cbf16.prefill_linear(short[i : i + 1], rows, bias), together[i : i + 1]) for i in range(5))


def test_what_the_kernel_does_not_take_goes_back_to_the_caller():
    w = torch.randn(8, 6, dtype=torch.bfloat16)
    assert cbf16.prefill_linear(torch.randn(4, 6), w.float(), None) is None  # float32
    assert cbf16.prefill_linear(torch.randn(1, 6), w.float(), None) is None  # float32, one token
    assert cbf16.prefill_linear(torch.randn(4, 5, dtype=torch.bfloat16), w[:, :5], None) is None  # odd K, strided
    assert cbf16.prefill_linear(torch.randn(4, 12, dtype=torch.bfloat16)[:, ::2], w, None) is None  # strided x
    assert cbf16.prefill_linear(torch.randn(4, 6, dtype=torch.bfloat16), w, torch.randn(8)) is None  # float32 bias


@needs_kernel
def test_a_bfloat16_model_computes_its_prefill_linears_in_the_kernel_and_stays_a_plain_model(monkeypatch):
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa").eval()  # biases
    plain = copy.deepcopy(reference).to(torch.bfloat16)
    fast = copy.deepcopy(plain)
    linears = sum(isinstance(m, torch.nn.Linear) for m in fast.modules())
    assert use_prefill_linears(fast) == linears
    assert all(type(m) is PrefillLinear for m in fast.modules() if isinstance(m, torch.nn.Linear))
    assert supports(fast) is None  # the fast decode step takes it as it took the plain model
    assert fast.state_dict().keys() == plain.state_dict().keys()
    calls = []
    kernel = cbf16.prefill_linear
    monkeypatch.setattr(cbf16, "prefill_linear", lambda *a: calls.append(1) or kernel(*a))
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = reference(input_ids=ids).logits
        torch_bf16 = plain(input_ids=ids).logits.float()
        got = fast(input_ids=ids).logits.float()
    assert len(calls) == linears
    kernel_error, torch_error = (got - want).abs().mean(), (torch_bf16 - want).abs().mean()
    assert 0 < kernel_error <= 1.1 * torch_error
    # with autograd on, the modules are nn.Linear's own product (the kernel has no backward)
    calls.clear()
    fast(input_ids=ids).logits.sum().backward()
    assert not calls and fast.lm_head.weight.grad is not None


def test_float32_and_non_plain_linears_are_left_as_they_are():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").eval()
    assert use_prefill_linears(model) == 0  # float32
    model = model.to(torch.bfloat16)

    class Adapted(torch.nn.Linear):
        pass

    model.lm_head.__class__ = Adapted
    plain = sum(type(m) is torch.nn.Linear for m in model.modules())
    swapped = use_prefill_linears(model)
    assert type(model.lm_head) is Adapted  # a subclass (an adapter, a quantized layer) computes something else
    assert swapped == (plain if cbf16.prefill_linear_available() else 0) and plain > 0
    assert sum(type(m) is PrefillLinear for m in model.modules()) == swapped
