"""The architecture check, the fingerprint and loading errors."""

import copy
import json

import pytest
import torch
from tiny import ARCHS, tiny_config, tiny_model
from transformers import AutoConfig, GPT2Config

from kvrag.errors import ModelNotFoundError, UnsupportedModelError
from kvrag.model.loading import check_architecture, fingerprint, load_pretrained, resolve_dtype, state_dict_digest
from kvrag.model.rope import find_rotary


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_supported_architectures_pass(arch):
    check_architecture(tiny_config(arch))


@pytest.mark.parametrize(
    "config, reason",
    [
        (GPT2Config(n_layer=1, n_embd=32, n_head=2), "absolute position embeddings"),
        (
            tiny_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            "dynamic NTK",
        ),
        (
            tiny_config(
                "llama", rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
            ),
            "mRoPE",
        ),
        (AutoConfig.for_model("qwen2_vl"), "mRoPE"),
        (tiny_config("mistral", sliding_window=64), "sliding-window"),
        (tiny_config("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding-window"),
        (
            tiny_config(
                "llama",
                rope_parameters={
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 8,
                    "original_max_position_embeddings": 128,
                },
            ),
            "RoPE type 'longrope'",
        ),
        (AutoConfig.for_model("bloom"), "ALiBi"),
        (AutoConfig.for_model("falcon"), "not verified"),
    ],
    ids=[
        "gpt2",
        "dynamic",
        "mrope-params",
        "qwen2_vl",
        "mistral-window",
        "qwen2-window",
        "longrope",
        "bloom",
        "falcon",
    ],
)
def test_refused_configurations_name_the_reason(config, reason):
    with pytest.raises(UnsupportedModelError, match=reason):
        check_architecture(config)


def test_window_covering_the_whole_context_is_accepted():
    check_architecture(tiny_config("mistral", sliding_window=512))  # = max_position_embeddings


def test_model_without_rotary_module_is_refused():
    class NoRope(torch.nn.Module):
        pass

    with pytest.raises(UnsupportedModelError, match="rotary"):
        find_rotary(NoRope())


def test_fingerprint_changes_with_weights_dtype_and_rope():
    model = tiny_model("llama")
    base = fingerprint(model, state_dict_digest(model))
    assert base == fingerprint(model, state_dict_digest(model))  # stable
    other = tiny_model("llama", seed=1)
    assert fingerprint(other, state_dict_digest(other)).digest != base.digest
    assert fingerprint(tiny_model("llama_linear"), base.weights).digest != base.digest  # rope differs
    half = copy.deepcopy(model).to(torch.float16)
    assert fingerprint(half, base.weights).digest != base.digest
    assert json.loads(base.rope) == {"rope_type": "default", "rope_theta": 10000.0}


def test_unknown_model_offline_says_how_to_supply_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="pass its path"):
        load_pretrained("no-such-org/no-such-model-kvrag", dtype=torch.float32, device="cpu", cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="not a local folder"):
        load_pretrained(tmp_path / "missing", dtype=torch.float32, device="cpu", cache_dir=tmp_path)


def test_local_folder_loads_with_a_content_digest(tmp_path):
    model = tiny_model("qwen2")
    model.save_pretrained(tmp_path / "m")
    from tiny import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "m")
    loaded, _, weights = load_pretrained(tmp_path / "m", dtype=torch.float32, device="cpu", cache_dir=tmp_path / "c")
    assert weights.startswith("files:")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    # memoized: the second load reads the digest back
    assert load_pretrained(tmp_path / "m", dtype=torch.float32, device="cpu", cache_dir=tmp_path / "c")[2] == weights


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype(None, "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", "cpu")


@pytest.mark.parametrize("native, device, asked, loaded", [
    (True, "cpu", "auto", torch.bfloat16),  # a CPU that multiplies bfloat16: the dtype it was converted to
    (False, "cpu", "auto", torch.float32),  # AVX2 alone: the same values in float32, several times faster there
    (False, "cpu", "bfloat16", torch.bfloat16),  # asked for by name: kept
    (False, "cuda", "auto", torch.bfloat16),  # not a CPU's choice
])
def test_a_named_bfloat16_model_computes_in_float32_on_a_cpu_without_bfloat16(monkeypatch, native, device, asked,
                                                                             loaded):
    from kvrag import KVModel, cpu
    from kvrag.model import runtime

    class Loaded(Exception):
        pass

    def load(name, *, dtype, **kwargs):
        raise Loaded(dtype)

    monkeypatch.setattr(cpu, "native_bfloat16", lambda: native)
    monkeypatch.setattr(runtime, "load_pretrained", load)
    with pytest.raises(Loaded) as got:
        KVModel.from_pretrained("qwen2.5-coder-0.5b", dtype=asked, device=device)
    assert got.value.args[0] == loaded


def test_native_bfloat16_reads_the_cpus_flags(monkeypatch):
    from kvrag import cpu

    for flags, native in [({"avx2", "fma"}, False), ({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True),
                          ({"asimd", "bf16"}, True), (None, True)]:
        monkeypatch.setattr(cpu, "_cpu_flags", lambda flags=flags: flags)
        assert cpu.native_bfloat16() is native
