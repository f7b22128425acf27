"""Tiny random models of every supported architecture, and a byte-level tokenizer; no weights, no network."""

from __future__ import annotations

import copy
import threading
from functools import lru_cache
from typing import Any, Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

VOCAB = 300
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=256,
    eos_token_id=257,
    tie_word_embeddings=False,
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# name -> (model_type, config overrides)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"rope_parameters": ROPE}),
    "qwen2": ("qwen2", {"rope_parameters": ROPE}),
    "qwen3": ("qwen3", {"rope_parameters": ROPE, "head_dim": 16}),
    # the Qwen2.5-Coder 1.5B's attention shape in small: head dim 128, RoPE base 1e6, 2 query heads a KV head
    "qwen2_hd128": (
        "qwen2",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "hidden_size": 256,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "initializer_range": 0.15,  # four times the width: half the spread keeps activations as the others'
        },
    ),
    "mistral": ("mistral", {"rope_parameters": ROPE, "sliding_window": None}),
    "phi3": ("phi3", {"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}),
    "phi3_full": ("phi3", {"rope_parameters": ROPE}),  # rotary over the whole head, as Phi-3-mini
    "gpt_neox": (
        "gpt_neox",
        {
            "rope_parameters": {**ROPE, "partial_rotary_factor": 0.25},
            "num_key_value_heads": 4,
            "use_parallel_residual": True,
        },
    ),
    "gemma": ("gemma", {"rope_parameters": ROPE, "head_dim": 16}),
    "llama_linear": ("llama", {"rope_parameters": {**ROPE, "rope_type": "linear", "factor": 2.0}}),
    "llama_llama3": (
        "llama",
        {
            "rope_parameters": {
                **ROPE,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        },
    ),
    "llama_yarn": (
        "llama",
        {"rope_parameters": {**ROPE, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
    ),
}


def tiny_config(name: str, **overrides: Any) -> Any:
    model_type, extra = ARCHS[name]
    # a copy: a config may fill in its rope_parameters in place (phi3 does), and ARCHS shares ROPE between them
    kwargs = {**COMMON, **copy.deepcopy(extra), **overrides}
    if model_type == "gpt_neox":
        kwargs.pop("num_key_value_heads")
    return AutoConfig.for_model(model_type, **kwargs)


@lru_cache(maxsize=None)
def tiny_model(name: str, seed: int = 0, attn: str = "sdpa") -> Any:
    """A random model, built once per (name, seed, attention) and shared: tests only read it."""
    torch.manual_seed(seed)
    config = tiny_config(name)
    config._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    return model.float().eval()


# The architectures kvrag's fast decode step takes (kvrag.cpu.decode.TAKEN, with RoPE over the whole head).
FAST_DECODED = [
    name
    for name, (model_type, extra) in ARCHS.items()
    if model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3")
    and "partial_rotary_factor" not in extra["rope_parameters"]
]

# A small corpus of invented facts with metadata, shared by the engine and adapter tests.
FACTS = [
    ("The lighthouse of Karsa was built in 1872 by the engineer Mira Holt.", {"topic": "buildings", "lang": "en"}),
    ("Velloria's harbour holds forty ships and is run by Orin Dask.", {"topic": "ports", "lang": "en"}),
    ("The river Tam floods every spring, covering the lower fields.", {"topic": "rivers", "lang": "en"}),
    ("Le pont de Sarnac a été construit en 1901.", {"topic": "buildings", "lang": "fr"}),
    ("The old mill of Brenn grinds barley and rye for three villages.", {"topic": "buildings", "lang": "en"}),
]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny(folder: Any, seed: int = 0) -> Any:
    """The tiny llama and the byte tokenizer saved as a model folder (for from_pretrained); returns the folder."""
    tiny_model("llama", seed=seed).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def byte_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are bytes (as GPT-2 byte characters), then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>", "<|im_start|>", "<|im_end|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<eos>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def in_threads(fn: Callable[[int], Any], n: int) -> list[Any]:
    """fn(0..n-1) run at once on n threads; the results in order."""
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class HashEmbedder:
    """A bag-of-words embedder (hashed words, unit length): fast, deterministic, and a question that shares a
    rare word with one chunk retrieves it. For tests that need many chunks or fresh processes."""

    DIM = 256

    def __init__(self, name: Any = None, device: str = "cpu") -> None:
        self.name = name
        self.source = "hash-bag-of-words"

    def embed(self, texts: Any) -> Any:
        import re
        import zlib

        import numpy as np

        out = np.zeros((len(texts), self.DIM), dtype=np.float32)
        for i, text in enumerate(texts):
            out[i, 0] = 1e-3  # never the zero vector
            for word in re.findall(r"\w+", text.lower()):
                out[i, zlib.crc32(word.encode()) % self.DIM] += 1.0
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def plan_of(name: str, lengths: list[int], **options: Any) -> Any:
    """The planner's decision for a request over chunks of these lengths, no probe (strategies that need none)."""
    from kvrag.plan.planner import make_plan
    from kvrag.plan.request import Request

    request = Request("q", ["x"] * len(lengths), strategy=name, **options).with_default(None)
    return make_plan(request, lengths, None)


def recomputed_tokens(plan: Any, lengths: list[int]) -> int:
    """Context tokens a plan recomputes (every token of its chunks for a full prefill)."""
    if plan.full_prefill:
        return sum(lengths[c] for c in plan.order)
    return sum(int(s.numel()) for s in plan.recompute.values())


# Five chunks of different lengths, and a question whose answer is in the last (strategy and picker tests).
STRATEGY_CHUNKS = [
    "Alpha station logs the weather every hour.",
    "The harbour master keeps ships' names in a ledger.",
    "Cats sleep most of the day and hunt at night, mostly mice.",
    "Zed is a short one.",
    "The archive opens at nine and closes at five on weekdays.",
]
STRATEGY_QUESTION = "When does the archive open?"


def edit_manifest(folder: Any, **changes: Any) -> None:
    """Change fields of an index folder's manifest as its owner would: re-signed with the user's key (what an edit
    by someone without the key cannot do; tests of that edit write the file by hand). A field given as ... is
    removed (a manifest written before the field was)."""
    import json

    from kvrag.engine.folder import MANIFEST, IndexFolder

    path = folder / MANIFEST
    manifest = {**json.loads(path.read_text()), **changes}
    manifest = {k: v for k, v in manifest.items() if v is not ...}
    if "mac" in manifest:
        manifest["mac"] = IndexFolder(folder)._mac(manifest)
    path.write_text(json.dumps(manifest))
