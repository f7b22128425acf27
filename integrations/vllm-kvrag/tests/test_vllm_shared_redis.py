"""Two vLLM engines in two processes over one Redis store: one ingestion stores each chunk's KV once, and both
engines, started at the same time by `kvrag ask --backend vllm`, answer from it without encoding anything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only (make test runs these tests there)")

from test_vllm_connector import TEXTS, Q  # noqa: E402

from kvrag.lab.bench.storage import start_redis  # noqa: E402


@pytest.fixture(scope="module")
def redis_url():
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed: .ci/run must install Debian's redis-server")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    started = start_redis(None, None)
    if started is None:
        pytest.fail("redis-server did not start")
    proc, port = started
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


def kvrag(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("kvrag")), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finished(process: subprocess.Popen, timeout: float = 600) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return out


def test_two_vllm_processes_answer_from_one_ingestions_kv_in_redis(tmp_path, redis_url):
    docs = tmp_path / "docs"
    docs.mkdir()
    for n, text in enumerate(TEXTS):
        (docs / f"{n}.txt").write_text(text)
    index = tmp_path / "index"
    common = ["--index", str(index), "--redis", redis_url]
    out = finished(kvrag("ingest", str(docs), *common, "--dtype", "float32", "--storage-dtype", "float32", "--quiet"))
    assert index.is_dir(), out
    ask = ["ask", Q, *common, "--strategy", "target_recompute", "--top-k", "3", "--max-new-tokens", "12", "--json"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}  # vLLM's own knob: 1 GiB of paged KV
    engines = [kvrag(*ask, "--backend", "vllm", env=env) for _ in range(2)]  # two engines at once, one store
    answers = [json.loads(finished(p)) for p in engines]  # stdout is the answer alone: vLLM logs to stderr
    here = json.loads(finished(kvrag(*ask)))  # kvrag's own engine over the same KV
    for got in answers:
        assert got["stats"]["chunks_encoded"] == 0  # nothing encoded: every chunk's KV came from Redis
        assert 0 < got["stats"]["recomputed_tokens"] < got["stats"]["context_tokens"]  # reused through the connector
        assert got["text"] == here["text"] and got["stats"]["order"] == here["stats"]["order"]
    assert "Mara" in here["text"]
