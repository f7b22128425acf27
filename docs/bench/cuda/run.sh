#!/usr/bin/env bash
# What produced this folder, on one H200 (torch 2.11 + CUDA 13, transformers 5.17), from the repository's root.
# SMOL: the converted default model's config, tokenizer and chat template files, without its weights.
set -u
SMOL=${SMOL:?the folder of the default model's config and tokenizer files}
OUT=${OUT:-docs/bench/cuda}
python3 -m pytest -q tests/behaviour/test_cuda.py | tee "$OUT/test_cuda.txt"
python3 docs/bench/cuda/make_model.py "$SMOL" /tmp/smol
python3 -c "import sys; from kvrag.cli import main; sys.exit(main())" bench-decode --model /tmp/smol --device cuda \
    --dtype bfloat16 --contexts 1000,4000,8000 --tokens 32 --runs 3 | tee "$OUT/bench-decode.txt"
python3 docs/bench/cuda/ttft.py /tmp/smol "$OUT/smollm2-shape" bfloat16 1000,4000,8000 3
python3 docs/bench/cuda/ttft.py "shape:$SMOL" "$OUT/7b-shape" bfloat16 1000,4000,8000 3
