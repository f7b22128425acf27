#!/usr/bin/env bash
# Everything of kvrag's GPU path that a GPU machine without vLLM (no package index) can check, in a few minutes:
# the connector's cache writes, rotation and layer pipeline on CUDA against the CPU (gpu_check.py, torch alone), the
# connector's load at a 7B shape, whole and layer by layer (bench_7b.py, torch alone), and, where transformers can be
# imported, kvrag's own engine on CUDA against full prefill (tests/behaviour/test_cuda.py).
# Run from anywhere: bash integrations/vllm-kvrag/scripts/gpu_check.sh
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
status=0
python3 "$here/gpu_check.py" --device cuda || status=1
python3 "$here/bench_7b.py" --device cuda --context 8192 || status=1
if python3 -c "import transformers, pytest" 2>/dev/null; then
    (cd "$root" && python3 -m pytest -q -p no:cacheprovider tests/behaviour/test_cuda.py) || status=1
else
    echo "tests/behaviour/test_cuda.py not run: transformers or pytest cannot be imported here"
fi
exit $status
