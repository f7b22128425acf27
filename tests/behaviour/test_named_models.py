"""The exactness suite on a real model a user would run: Qwen2.5-Coder-0.5B-Instruct (qwen2, RoPE base 1e6,
head dim 64, 2 KV heads, q/k/v biases), converted from its registry packages; and the 1.5B (head dim 128) where
it is installed (`make model-1.5b`).

In float32, so that the comparisons against full prefill measure the mechanism, not bfloat16's rounding. Prints
its figures: run with `-s` to see them.
"""

import pytest
import torch

from kvrag import KVModel
from kvrag.cache.kv import ChunkKV
from kvrag.model import catalog
from kvrag.model.encode import stacked_kv
from kvrag.run.generate import Sampling, decode
from kvrag.model.recompute import full_prefill, recompute

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not catalog.installed(catalog.QWEN_05B), reason="the Qwen2.5-Coder 0.5B parts (make install)"),
]

TEXTS = [
    "The Zarnik bridge over the river Olm was built in 1873 by the engineer Elsa Morrow.",
    "The Velt tower in Carran is 212 metres tall and was finished in 1931.",
    "Ships leaving the port of Dessa carry salt, copper and dried fish to the southern islands.",
]
QUESTION = "Who built the Zarnik bridge, and how tall is the Velt tower?"
TOL = 2e-4  # float32 logits reach ~32 here; measured 2-4e-5


@pytest.fixture(scope="module")
def kv():
    return KVModel.from_pretrained("qwen2.5-coder-0.5b", dtype="float32", decode_weights="model")  # exact tokens


def _exact_chunks(kv, ids, suffix):
    """Each chunk's KV sliced from one full prefill, at its true position; and that prefill."""
    prompt = kv.layout.prefix_ids + [t for c in ids for t in c] + suffix
    ref = full_prefill(kv.model, prompt, logits_to_keep=len(suffix))
    out, pos = [], len(kv.prefix)
    for part in ids:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(part))
        out.append(ChunkKV(torch.tensor(part), k, v, start=pos))
        pos += len(part)
    return ref, out


def test_the_named_model_is_the_pinned_file(kv):
    config = kv.model.config
    assert kv.fingerprint.weights == catalog.QWEN_05B.weights and config.model_type == "qwen2"
    assert config.rope_parameters["rope_theta"] == 1e6 and kv.repositioner.rotary_dim == 64
    assert kv.model.model.layers[0].self_attn.q_proj.bias is not None  # q/k/v biases


def test_recompute_against_full_prefill_on_the_real_model(kv):
    ids = [kv.layout.chunk_ids(t) for t in TEXTS]
    suffix = kv.layout.suffix_ids(QUESTION)
    encoded = kv.encode(TEXTS)
    rep, prefix = kv.repositioner, kv.prefix
    order = [2, 0, 1]
    ref_order = full_prefill(
        kv.model, kv.layout.prefix_ids + [t for c in order for t in ids[c]] + suffix, logits_to_keep=len(suffix)
    )
    everything = {c: torch.arange(len(ids[c])) for c in order}
    all_recomputed = recompute(kv.model, rep, prefix, encoded, order, everything, suffix, logits_to_keep=len(suffix))
    one = recompute(kv.model, rep, prefix, encoded[:1], [0], {}, suffix, logits_to_keep=len(suffix))
    ref_one = full_prefill(kv.model, kv.layout.prefix_ids + ids[0] + suffix, logits_to_keep=len(suffix))
    ref, exact = _exact_chunks(kv, ids, suffix)
    middle = recompute(
        kv.model, rep, prefix, exact, [0, 1, 2], {1: torch.arange(len(ids[1]))}, suffix, logits_to_keep=len(suffix)
    )
    plain = recompute(kv.model, rep, prefix, encoded, [0, 1, 2], {}, suffix, logits_to_keep=len(suffix))
    diffs = {
        "every context token recomputed": (all_recomputed.logits - ref_order.logits).abs().max().item(),
        "one chunk reused": (one.logits - ref_one.logits).abs().max().item(),
        "middle chunk recomputed, others exact": (middle.logits - ref.logits).abs().max().item(),
        "plain stitching (must differ)": (plain.logits - ref.logits).abs().max().item(),
    }
    scale = ref.logits.abs().max()
    print(f"\nQwen2.5-Coder-0.5B float32, max |logit diff| vs full prefill (logits up to {scale:.1f}):")
    for name, diff in diffs.items():
        print(f"  {name}: {diff:.2e}")
    assert max(list(diffs.values())[:3]) < TOL
    assert diffs["plain stitching (must differ)"] > 10 * TOL  # the comparison can fail


def test_exact_plans_give_full_prefills_tokens(kv):
    ids = [kv.layout.chunk_ids(t) for t in TEXTS]
    suffix = kv.layout.suffix_ids(QUESTION)
    ref, exact = _exact_chunks(kv, ids, suffix)
    got = recompute(kv.model, kv.repositioner, kv.prefix, exact, [0, 1, 2], {1: torch.arange(len(ids[1]))}, suffix)
    sampling = Sampling(max_new_tokens=40)
    full = full_prefill(kv.model, kv.layout.prefix_ids + [t for c in ids for t in c] + suffix)
    tokens = list(decode(kv.model, got.cache, got.logits[-1], got.next_position, sampling, eos_ids=[]))
    expected = list(decode(kv.model, full.cache, full.logits[-1], full.next_position, sampling, eos_ids=[]))
    print(f"\n{kv.tokenizer.decode(expected)!r}")
    assert tokens == expected and len(tokens) == 40
    # through the public API: the full_prefill strategy and a single chunk reused answer as transformers does
    answer = kv.answer(QUESTION, TEXTS, strategy="full_prefill", max_new_tokens=40)
    one = kv.answer(QUESTION, kv.encode(TEXTS[:1]), strategy="reuse", max_new_tokens=16)
    with torch.inference_mode():
        generated = kv.model.generate(
            torch.tensor([kv.prompt_ids(QUESTION, ids, range(3))]), max_new_tokens=40, do_sample=False
        )
        generated_one = kv.model.generate(
            torch.tensor([kv.prompt_ids(QUESTION, ids[:1], [0])]), max_new_tokens=16, do_sample=False
        )
    n, n1 = len(kv.prompt_ids(QUESTION, ids, range(3))), len(kv.prompt_ids(QUESTION, ids[:1], [0]))
    assert answer.token_ids == [t for t in generated[0, n:].tolist() if t not in kv.eos_ids]
    assert one.token_ids == [t for t in generated_one[0, n1:].tolist() if t not in kv.eos_ids]
    assert "Elsa Morrow" in answer.text and "212" in answer.text  # the model answers both parts


def _keys_at(model, ids, offset):
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=ids, position_ids=torch.arange(offset, offset + ids.shape[1]).view(1, -1), cache=cache)
    return stacked_kv(cache, 0, 0, ids.shape[1])[0]  # [L, H_kv, T, D]


def _repositioning_error(kv, offset):
    ids = torch.tensor([kv.layout.chunk_ids(TEXTS[0])])
    stored, expected = _keys_at(kv.model, ids, 7), _keys_at(kv.model, ids, 7 + offset)
    moved = kv.repositioner.shift(stored, torch.full((ids.shape[1],), offset))
    return ((moved - expected).norm() / expected.norm()).item(), ((stored - expected).norm() / expected.norm()).item()


# Both sides compute their angles in float32: at position 20,000 an angle's rounding alone is ~1e-3 rad in the
# fastest frequency, so the bound grows with the offset (the 135M's 500-token shift: 8.4e-5 absolute).
BOUNDS = {1: 1e-5, 500: 1e-5, 20000: 1e-4}


@pytest.mark.parametrize("offset", sorted(BOUNDS))
def test_repositioning_at_rope_base_1e6_head_dim_64(kv, offset):
    err, unmoved = _repositioning_error(kv, offset)
    print(f"\n0.5B keys moved by {offset}: relative error {err:.1e} (unmoved {unmoved:.1e})")
    assert err < BOUNDS[offset] and unmoved > 1e-3


@pytest.mark.skipif(not catalog.installed(catalog.QWEN_15B), reason="the 1.5B is optional: make model-1.5b")
def test_repositioning_at_rope_base_1e6_head_dim_128_on_the_1_5b():
    kv15 = KVModel.from_pretrained("qwen2.5-coder-1.5b", dtype="float32")
    assert kv15.repositioner.rotary_dim == 128
    for offset, bound in BOUNDS.items():
        err, unmoved = _repositioning_error(kv15, offset)
        print(f"\n1.5B keys moved by {offset}: relative error {err:.1e} (unmoved {unmoved:.1e})")
        assert err < bound and unmoved > 1e-3


def test_the_plan_by_need_answers_what_the_chunks_say_and_declines_what_they_do_not(kv):
    chunks = kv.encode(TEXTS)
    asked = kv.answer("When was the Zarnik bridge built?", chunks, strategy="by_need", max_new_tokens=40)
    assert not asked.abstained and "1873" in asked.text and asked.stats.signals["lift"] > 0.1
    silent = kv.answer("What is the capital of Australia?", chunks, strategy="by_need", max_new_tokens=16)
    assert silent.abstained and silent.text == "The documents do not say." and silent.draft
    print("\nby_need lifts:", asked.stats.signals["lift"], silent.stats.signals["lift"], repr(silent.draft))
