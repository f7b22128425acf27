"""A model folder with a source folder's config and tokenizer and random weights (seed 0).

    python docs/bench/cuda/make_model.py SOURCE OUT

SOURCE: the converted default model's folder without its weights (config, tokenizer and chat template files of
~/.cache/kvrag/models/SmolLM2-135M-Instruct-Q4_1-*/): the default model's shapes, for timing on a machine its
weights are not copied to. Timing does not depend on the weights' values.
"""

import shutil
import sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM

src, out = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32)
model.save_pretrained(out)
for f in src.iterdir():
    if f.name not in ("config.json", "model.safetensors", "kvrag.json"):
        shutil.copy(f, out / f.name)
print("model", out, sum(p.numel() for p in model.parameters()))
