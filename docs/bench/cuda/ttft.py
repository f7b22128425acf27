"""`kvrag bench`'s time to first token and whole answers on a GPU, without its ingest and storage sections (they
need the default embedder's weights): the same `kvrag.bench.ttft_benchmark`, and the same tables.

    python docs/bench/cuda/ttft.py MODEL OUT DTYPE CONTEXTS RUNS

MODEL is a model folder, or `shape:FOLDER` for a 7B shape (Qwen2.5-7B's layers, heads and vocabulary) with
random weights built on the GPU and FOLDER's tokenizer. Timing does not depend on the weights' values: every
answer decodes past EOS to its 32 tokens.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch

from kvrag.bench import ttft_benchmark
from kvrag.bench_report import _answer_table, _machine, _phase_table, _ttft_tables, plot
from kvrag.defaults import shipped_default
from kvrag.engine import KVRAG
from kvrag.kvmodel import KVModel
from kvrag.store import MemoryStore


class NoEmbedder:
    """The bench gives every answer its chunks: nothing is retrieved."""

    name, source = None, "none"

    def embed(self, texts):
        return np.ones((len(texts), 8), dtype=np.float32) / 8**0.5


model, out, dtype, contexts = sys.argv[1], Path(sys.argv[2]), sys.argv[3], [int(c) for c in sys.argv[4].split(",")]
runs = int(sys.argv[5])
if model.startswith("shape:"):  # a 7B shape with random weights, built on the GPU (the tokenizer: SmolLM2's)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    config = AutoConfig.for_model("qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=None, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        big = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    big.generation_config.eos_token_id = 2
    kv = KVModel(big.eval(), AutoTokenizer.from_pretrained(model.removeprefix("shape:")))
else:
    kv = KVModel.from_pretrained(model, device="cuda", dtype=dtype)
rag = KVRAG(kv, embedder=NoEmbedder(), store=MemoryStore(8 << 30))
strategies = ["full_prefill", "reuse", "target_recompute"]
result = {"command": " ".join(sys.argv), "machine": _machine(kv) | {"gpu": torch.cuda.get_device_name()},
          "budget": 0.05, "default": shipped_default(kv.fingerprint.weights), "runs": runs, "chunk_tokens": 200, "strategies": strategies, "answer_tokens": 32}
result["ttft"] = ttft_benchmark(kv, rag, contexts=contexts, strategies=strategies, runs=runs, answer_tokens=32)
out.mkdir(parents=True, exist_ok=True)
(out / "bench.json").write_text(json.dumps(result, indent=1))
lines = _ttft_tables(result) + _answer_table(result) + _phase_table(result)
(out / "bench.md").write_text(f"{result['machine']}\n\n" + "\n".join(lines) + "\n")
print("\n".join(lines))
