"""kvrag_sdpa: transformers' sdpa without copying kv heads on CPU, bitwise the same on every architecture."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa
from tiny import ARCHS, VOCAB, byte_tokenizer, tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from kvrag.compat import with_cache
from kvrag.cpu import cbf16
from kvrag.cpu.attention import GQA_SDPA, use_gqa_sdpa
from kvrag.model.kvmodel import KVModel
from kvrag.model.recompute import causal_mask


def _copies_kv_heads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count transformers' repeat_kv calls that copy (more than one query head a kv head)."""
    calls: list[int] = []
    original = hf_sdpa.repeat_kv

    def counting(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
        calls.extend([n_rep] if n_rep > 1 else [])
        return original(hidden, n_rep)

    monkeypatch.setattr(hf_sdpa, "repeat_kv", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_masked_forward_is_bitwise_sdpas_and_copies_no_kv_head(arch, dtype, monkeypatch):
    # kvrag's bfloat16 prefill kernel (tested in test_ckernel.py, not bitwise by design) takes head sizes that are
    # multiples of 32: here the sdpa path it would stand in for is tested
    monkeypatch.setattr(cbf16, "prefill_attention", lambda *args: None)
    plain = copy.deepcopy(tiny_model(arch)).to(dtype)
    plain.set_attn_implementation("sdpa")
    fast = copy.deepcopy(plain)
    use_gqa_sdpa(fast)
    assert fast.config._attn_implementation == GQA_SDPA
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 11), generator=g)
    positions = torch.arange(11)
    mask = causal_mask(positions, positions, dtype).expand(2, 1, 11, 11)  # a 4-D mask, as stitched prefills pass
    with torch.inference_mode():
        want = plain(input_ids=ids, attention_mask=mask).logits
        copies = _copies_kv_heads(monkeypatch)
        got = fast(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(got, want) and not copies
        plain(input_ids=ids, attention_mask=mask)
    grouped = getattr(plain.config, "num_key_value_heads", None) not in (None, plain.config.num_attention_heads)
    assert bool(copies) == grouped  # transformers' own sdpa copies grouped heads: the check above can fail


def test_kvmodel_switches_an_sdpa_model_and_leaves_eager_as_it_is():
    model = copy.deepcopy(tiny_model("llama"))
    model.set_attn_implementation("sdpa")
    KVModel(model, byte_tokenizer())
    assert model.config._attn_implementation == GQA_SDPA
    KVModel(model, byte_tokenizer())  # a second engine over the same model accepts it
    eager = copy.deepcopy(tiny_model("llama"))
    eager.set_attn_implementation("eager")
    KVModel(eager, byte_tokenizer())
    assert eager.config._attn_implementation == "eager"


def test_one_token_and_unmasked_calls_are_transformers_own(monkeypatch):
    model = copy.deepcopy(tiny_model("llama"))
    model.set_attn_implementation("sdpa")
    reference = copy.deepcopy(model)
    use_gqa_sdpa(model)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)
        out = model(input_ids=ids[:, :8], use_cache=True)
        step = model(input_ids=ids[:, 8:], **with_cache(model, out.past_key_values)).logits
        ref = reference(input_ids=ids[:, :8], use_cache=True)
        assert torch.equal(step, reference(input_ids=ids[:, 8:], **with_cache(reference, ref.past_key_values)).logits)


@pytest.mark.skipif(cbf16._prefill_library() is None, reason="no AVX512-BF16 CPU or no compiler")
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 2), (2, 2)])
@pytest.mark.parametrize("masked", [True, False], ids=["kvrag's additive mask", "no mask (causal)"])
def test_a_bfloat16_prefill_attends_through_the_kernel_as_close_to_float32_as_sdpa(heads, kv_heads, masked, monkeypatch):
    torch.manual_seed(0)
    config = tiny_config("llama", hidden_size=64 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()  # float32
    plain = copy.deepcopy(reference).to(torch.bfloat16)
    fast = copy.deepcopy(plain)
    use_gqa_sdpa(fast)
    calls = []
    kernel = cbf16.prefill_attention
    monkeypatch.setattr(cbf16, "prefill_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    ids = torch.randint(0, VOCAB, (2, 70), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(70)

    def mask(dtype):
        return causal_mask(positions, positions, dtype).expand(2, 1, 70, 70) if masked else None

    with torch.inference_mode():
        want = reference(input_ids=ids, attention_mask=mask(torch.float32)).logits
        sdpa = plain(input_ids=ids, attention_mask=mask(torch.bfloat16)).logits.float()
        got = fast(input_ids=ids, attention_mask=mask(torch.bfloat16)).logits.float()
    assert len(calls) == config.num_hidden_layers  # every layer's prefill attention ran in the kernel
    kernel_error, sdpa_error = (got - want).abs().mean(), (sdpa - want).abs().mean()
    assert 0 < kernel_error <= 1.1 * sdpa_error  # bfloat16 costs something; the kernel costs no more than sdpa
