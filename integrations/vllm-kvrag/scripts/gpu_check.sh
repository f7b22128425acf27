#!/usr/bin/env bash
# Everything of kvrag's GPU path that a GPU machine with torch alone can check (no vLLM, no package index), in a few
# minutes: the connector's cache writes, rotation and layer pipeline on CUDA against the CPU (gpu_check.py), the
# time to first token at a 7B shape (bench_7b.py), and, where transformers can be imported (or installed from wheels
# in $KVRAG_WHEELS, e.g. carried there), kvrag's own engine on CUDA against full prefill (tests/test_cuda.py).
# Run from the repository's root: bash integrations/vllm-kvrag/scripts/gpu_check.sh
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
status=0
python "$here/gpu_check.py" --device cuda || status=1
python "$here/bench_7b.py" --device cuda --context 8192 || status=1
if [ -n "${KVRAG_WHEELS:-}" ] && ! python -c "import transformers" 2>/dev/null; then
    python -m pip install --quiet --no-index --no-deps --target /tmp/kvrag-deps "$KVRAG_WHEELS"/*.whl \
        && export PYTHONPATH="/tmp/kvrag-deps${PYTHONPATH:+:$PYTHONPATH}"
fi
if python -c "import transformers, pytest" 2>/dev/null; then
    (cd "$root" && PYTHONPATH="$root:$root/tests${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -p no:cacheprovider \
        tests/test_cuda.py) || status=1
else
    echo "tests/test_cuda.py not run: transformers and pytest cannot be imported here (give their wheels in KVRAG_WHEELS)"
fi
exit $status
