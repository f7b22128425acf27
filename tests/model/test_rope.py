"""Re-positioning: keys rotated to an offset equal keys encoded at that offset (fp32, relative error < 1e-5)."""

import pytest
import torch
from tiny import ARCHS, VOCAB, tiny_model
from transformers import DynamicCache

from kvrag.model.encode import stacked_kv
from kvrag.model.rope import Repositioner


def keys_at(model, ids, offset):
    cache = DynamicCache()
    positions = torch.arange(offset, offset + ids.shape[1]).view(1, -1)
    with torch.inference_mode():
        model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return stacked_kv(cache, 0, 0, ids.shape[1])[0]  # [L, H_kv, T, D]


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("offset", [1, 37, 300])
def test_rotated_keys_equal_keys_encoded_at_offset(arch, offset):
    model = tiny_model(arch)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(1))
    start = 5
    stored = keys_at(model, ids, start)
    expected = keys_at(model, ids, start + offset)
    moved = Repositioner(model).shift(stored, torch.full((24,), offset))
    err = ((moved - expected).norm() / expected.norm()).item()
    assert err < 1e-5, f"{arch}: relative error {err:.2e}"
    # The rotation must matter: unmoved keys are far from the keys at the offset.
    assert ((stored - expected).norm() / expected.norm()).item() > 1e-3


def test_partial_rotary_leaves_pass_through_dims_untouched():
    model = tiny_model("gpt_neox")  # rotary on a quarter of each head
    rep = Repositioner(model)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert rep.rotary_dim == head_dim // 4
    keys = torch.randn(2, 4, 6, head_dim)
    moved = rep.shift(keys, torch.full((6,), 9))
    assert torch.equal(moved[..., rep.rotary_dim :], keys[..., rep.rotary_dim :])
    assert not torch.allclose(moved[..., : rep.rotary_dim], keys[..., : rep.rotary_dim])


def test_shift_does_not_modify_its_input_and_keeps_dtype():
    model = tiny_model("llama")
    keys = torch.randn(2, 2, 5, 16, dtype=torch.bfloat16)
    before = keys.clone()
    moved = Repositioner(model).shift(keys, torch.arange(5))
    assert moved.dtype == torch.bfloat16 and torch.equal(keys, before)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox", "gemma"])
def test_the_rotary_module_built_from_the_config_moves_keys_exactly_as_the_models_own(arch):
    """A serving engine's worker holds no transformers model: it re-positions with the config's rotary module."""
    from kvrag.model.rope import rotary_of_config

    model = tiny_model(arch)
    own, built = Repositioner(model), Repositioner(rotary=rotary_of_config(model.config))
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    keys = torch.randn(2, 2, 5, head_dim)
    deltas = torch.tensor([3, 7, 100, 2, 9])
    assert own.rotary_dim == built.rotary_dim and torch.equal(own.shift(keys, deltas), built.shift(keys, deltas))


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("phi3", torch.float32), ("llama", torch.bfloat16)])
def test_keys_rotated_a_few_layers_at_a_time_equal_one_pass_over_all(arch, dtype, monkeypatch):
    import kvrag.model.rope

    rep = Repositioner(tiny_model(arch))
    keys = torch.randn(6, 2, 3000, 16, generator=torch.Generator().manual_seed(3)).to(dtype)  # 384 KB a layer
    cos, sin = rep.angles(torch.tensor([517]))
    monkeypatch.setattr(kvrag.model.rope, "_ROTATE_BLOCK_BYTES", 800_000)  # two layers a block, three blocks
    blocked = torch.empty_like(keys)
    rep.rotate_into(blocked, keys, cos[0], sin[0])
    monkeypatch.setattr(kvrag.model.rope, "_ROTATE_BLOCK_BYTES", 1 << 40)  # every layer in one pass
    whole = torch.empty_like(keys)
    rep.rotate_into(whole, keys, cos[0], sin[0])
    assert torch.equal(blocked, whole)
    half, rot = rep.rotary_dim // 2, rep.rotary_dim
    k = keys.float()[..., :rot]
    want = k * cos[0] + torch.cat((-k[..., half:], k[..., :half]), -1) * sin[0]  # the formula, written plainly
    assert torch.allclose(
        blocked[..., :rot].float(), want.to(dtype).float(), atol=1e-2 if dtype != torch.float32 else 1e-5
    )
    assert torch.equal(blocked[..., rot:], keys[..., rot:])
