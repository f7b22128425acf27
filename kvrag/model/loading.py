"""Model loading, the model fingerprint and the architecture check.

This module owns where weights come from (the embedded default, a Hugging Face id, a folder) and what
identifies them. It never runs a forward pass and knows nothing about prompts or chunks.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvrag.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from kvrag.compat import rope_parameters
from kvrag.model.catalog import DEFAULT, EMBEDDED_WEIGHTS, default_cache_dir, file_sha256, resolve

__all__ = ["EMBEDDED_WEIGHTS", "default_cache_dir"]  # re-exported: the embedded default's weights id, the cache

DEFAULT_MODEL_NAME = DEFAULT.title

# Architectures whose attention applies rotate-half RoPE from one `rotary_emb` module to every layer,
# with the exactness suite run on each (tests/behaviour/test_exactness.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gpt_neox", "gemma")
# RoPE types under which moving a key from position p to p + d is one fixed rotation by d.
ROTATION_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_REFUSED_MODEL_TYPES = {
    "gpt2": "absolute position embeddings: a token's position is added to its input, not rotated into its key",
    "opt": "absolute position embeddings: a token's position is added to its input, not rotated into its key",
    "gpt_bigcode": "absolute position embeddings: a token's position is added to its input",
    "bloom": "ALiBi position biases, not rotary embeddings",
    "gptj": "interleaved (rotate-every-two) rotary embeddings, which kvrag does not implement",
    "qwen2_vl": "mRoPE (multimodal rotary sections)",
    "qwen2_5_vl": "mRoPE (multimodal rotary sections)",
    "gemma2": "sliding-window layers",
    "gemma3": "sliding-window layers",
    "gemma3_text": "sliding-window layers",
}


def check_architecture(config: Any) -> None:
    """Refuse a model whose cached keys cannot be moved to a new position by a rotation.

    Raises:
        UnsupportedModelError: naming the reason (absolute positions, dynamic NTK scaling, mRoPE,
            sliding-window layers, an architecture kvrag has not verified).
    """
    model_type = getattr(config, "model_type", "?")
    name = f"model type '{model_type}'"
    if model_type in _REFUSED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} is not supported: {_REFUSED_MODEL_TYPES[model_type]}, so a cached chunk's keys cannot be "
            f"re-positioned. Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name} is not supported (kvrag has not verified its position scheme). "
            f"Supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    rope = rope_parameters(config)
    rope_type = rope.get("rope_type", "default")
    if "mrope_section" in rope or "mrope" in str(rope_type):
        raise UnsupportedModelError(f"{name} uses mRoPE (multimodal rotary sections); kvrag cannot re-position it.")
    if rope_type == "dynamic":
        raise UnsupportedModelError(
            f"{name} uses dynamic NTK RoPE scaling: its rotary frequencies change with the sequence length, so "
            "moving a cached key is not one rotation. Use a model with default, linear, llama3 or yarn scaling."
        )
    if rope_type not in ROTATION_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{name} uses RoPE type '{rope_type}', which kvrag does not re-position "
            f"(accepted: {', '.join(ROTATION_ROPE_TYPES)})."
        )
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    sliding = any(t != "full_attention" for t in layer_types) or (
        window is not None and (max_positions is None or window < max_positions)
    )
    if sliding:
        raise UnsupportedModelError(
            f"{name} has sliding-window layers (window {window}): tokens outside the window are dropped, so a "
            "stitched cache does not match full prefill. Use a model without a sliding window (or one whose "
            "window covers its whole context)."
        )


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What identifies a model's KV: two models with equal fingerprints produce the same KV for the same ids."""

    architecture: str  # config.model_type and the model class
    weights: str  # a digest of the weight files, or hub id@revision
    dtype: str  # e.g. "float32"
    rope: str  # canonical JSON of config.rope_parameters
    shape: str  # layers x kv heads x head dim

    @property
    def digest(self) -> str:
        """A hex sha256 over every field, stable across processes (made once a fingerprint: every chunk's store key
        starts from it)."""
        return _digest(self)


@functools.lru_cache(maxsize=64)
def _digest(fingerprint: ModelFingerprint) -> str:
    blob = json.dumps(asdict(fingerprint), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


def fingerprint(model: torch.nn.Module, weights: str) -> ModelFingerprint:
    """Fingerprint a loaded model given an identifier of its weights."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return ModelFingerprint(
        architecture=f"{config.model_type}:{type(model).__name__}",
        weights=weights,
        dtype=str(model.dtype).removeprefix("torch."),
        rope=json.dumps(rope_parameters(config), sort_keys=True, default=str),
        shape=f"{config.num_hidden_layers}x{kv_heads}x{head_dim}",
    )


def state_dict_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name and bytes: the weights id of a model built in memory."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu").reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return "sd:" + h.hexdigest()


def _folder_digest(folder: Path, cache_dir: Path) -> str:
    """sha256 over a folder's weight files, memoized by (path, size, mtime) so a reload costs nothing."""
    files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file())
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    memo_path = cache_dir / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    key = hashlib.sha256(json.dumps([str(folder.resolve()), stamp]).encode()).hexdigest()
    if key not in memo:
        h = hashlib.sha256()
        for p in files:
            h.update(p.name.encode())
            h.update(file_sha256(p).encode())
        memo[key] = h.hexdigest()
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    return "files:" + memo[key]


def check_device(device: str) -> str:
    """A device torch can use here, or an error saying why not."""
    try:
        kind = torch.device(device).type
    except RuntimeError as err:
        raise InvalidRequestError(f"unknown device '{device}': use cpu or cuda (cuda:N)") from err
    if kind == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError(f"device '{device}' asked for, but this torch build sees no CUDA device: use cpu")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    """`None`/"auto": float32 on CPU, bfloat16 on CUDA; otherwise the named dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "float16": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
    }
    if dtype not in names:
        raise InvalidRequestError(f"unknown dtype '{dtype}': use one of {', '.join(names)} or 'auto'")
    return names[dtype]


def package_dir(package: str, missing: str) -> Path:
    """The folder of an installed package, found without importing it (ModelNotFoundError `missing` if absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(missing)
    return Path(spec.origin).parent


def load_pretrained(
    name_or_path: str | os.PathLike[str] | None,
    *,
    dtype: torch.dtype,
    device: str,
    cache_dir: Path | None = None,
    attn_implementation: str | None = None,
) -> tuple[Any, Any, str]:
    """Load (model, tokenizer, weights id) from a named model (`kvrag models`; None: the embedded default), a local
    folder or a Hugging Face id, offline-friendly. A named model is converted once into `cache_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_device(device)
    source = resolve(name_or_path, cache_dir)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ModelNotFoundError(
            f"could not load model '{source}': it is not a local folder with a config.json and it is not in the "
            f"Hugging Face cache ({type(err).__name__}). Without network, download it elsewhere "
            f"(`hf download {source}`) and copy the folder here, then pass its path; or name a model kvrag installs "
            "offline (`kvrag models` lists them), or omit the model to use the embedded default."
        ) from err
    check_architecture(config)
    # safetensors only: weights in a format that can run code when read (.bin, .pt) are refused, never loaded
    kwargs: dict[str, Any] = {"dtype": dtype, "use_safetensors": True}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs).to(device).eval()
    except (OSError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ModelNotFoundError(
            f"could not load the weights of model '{source}' ({first}): kvrag reads safetensors weights only; "
            "convert others with transformers' `save_pretrained` (it writes model.safetensors)"
        ) from err
    tokenizer = AutoTokenizer.from_pretrained(source)
    return model, tokenizer, weights_id(model, cache_dir)


def weights_id(model: Any, cache_dir: Path | None = None) -> str:
    """What identifies a loaded model's weights, cheapest first.

    A folder written by kvrag's conversion carries its source digest; another local folder is hashed once
    (memoized by file size and mtime); a hub model is its id and commit; a model built in memory is a
    digest of its state dict.
    """
    source = str(getattr(model.config, "_name_or_path", "") or "")
    folder = Path(source) if source else None
    if folder is not None and folder.is_dir():
        meta = folder / "kvrag.json"
        if meta.is_file():
            return json.loads(meta.read_text())["weights"]
        return _folder_digest(folder, Path(cache_dir) if cache_dir is not None else default_cache_dir())
    revision = getattr(model.config, "_commit_hash", None)
    if source and revision:
        return f"hub:{source}@{revision}"
    return state_dict_digest(model)
