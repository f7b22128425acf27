"""Tensor parallelism through kvrag's connector, end to end on vLLM's CPU build: Qwen2.5-Coder 0.5B (2 kv heads)
split over two workers, each writing its own kv head of every stored entry, against one worker holding both.

vLLM's CPU workers each bind their OpenMP threads to CPUs of their own; on a machine with one NUMA node vLLM
asks for that binding to be given (`VLLM_CPU_OMP_THREADS_BIND`), so the test gives each worker half the CPUs."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only (make test runs these tests there)")

from kvrag import KVModel, Request
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.store import DiskStore
from kvrag.model import catalog
from kvrag.run import pipeline

pytestmark = [
    pytest.mark.skipif(not catalog.installed(catalog.QWEN_05B), reason="the Qwen2.5-Coder 0.5B parts (make install)"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two tensor-parallel workers need two CPUs"),
]

FILLER = " The town keeps a small museum of maps, a ferry to the islands and a fish market by the old wall."
TEXTS = [
    "The Zarnik bridge over the river Olm was built in 1873 by the engineer Elsa Morrow." + FILLER,
    "The Velt tower in Carran is 212 metres tall and was finished in 1931." + FILLER,
    "Ships leaving the port of Dessa carry salt, copper and dried fish to the southern islands." + FILLER,
]
ASKS = [
    ("Who built the Zarnik bridge?", dict(strategy="target_recompute", scores=[0.9, 0.2, 0.4])),
    ("How tall is the Velt tower?", dict(strategy="reuse", scores=[0.3, 0.9, 0.1])),
    ("What do ships from Dessa carry?", dict(strategy="target_recompute", scores=[0.1, 0.2, 0.9])),
]


def _engine(folder: str, root: str, tp: int):
    from vllm import LLM
    from vllm_kvrag.executor import connector_config

    return LLM(
        model=folder,
        dtype="float32",
        max_model_len=1024,
        block_size=32,
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 28,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=connector_config(
            {"store": "disk", "path": root, "storage_dtype": "float32", "unkeyed": True}
        ),
    )


def _answers(kv, llm, store) -> list[list[int]]:
    from vllm_kvrag.executor import VLLMExecutor

    executor = VLLMExecutor(kv, llm, store)
    out = []
    for question, options in ASKS:
        request = Request.of(question, TEXTS, max_new_tokens=24, **options)
        chunks = ChunkSource(kv, store).chunks(request.chunks)
        *_, final = pipeline.stream(kv, request, chunks, executor, started_at=time.perf_counter())
        assert final.stats.recomputed_tokens < final.stats.context_tokens  # stored KV was loaded, not all computed
        out.append(final.token_ids)
    return out


def test_two_workers_each_writing_its_own_kv_heads_answer_as_one_worker(tmp_path, monkeypatch):
    folder = catalog.resolve("qwen2.5-coder-0.5b")
    kv = KVModel.from_pretrained(folder, dtype="float32", decode_weights="model")
    assert kv.model.config.num_key_value_heads == 2  # one a worker at TP=2
    store = DiskStore(tmp_path, "float32")
    hf = []
    for question, options in ASKS:  # kvrag's transformers path; it also stores every entry the plans read
        request = Request.of(question, TEXTS, max_new_tokens=24, **options)
        chunks = ChunkSource(kv, store).chunks(request.chunks)
        *_, final = pipeline.stream(kv, request, chunks, kv.executor, started_at=time.perf_counter())
        hf.append(final.token_ids)

    answers = {}
    for tp in (1, 2):
        if tp == 2:
            cpus = sorted(os.sched_getaffinity(0))
            half = len(cpus) // 2
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{_span(cpus[:half])}|{_span(cpus[half : 2 * half])}")
        llm = _engine(folder, str(tmp_path), tp)
        try:
            answers[tp] = _answers(kv, llm, store)
        finally:
            llm.llm_engine.engine_core.shutdown()
    assert answers[2] == answers[1] == hf
    assert all(len(a) > 4 for a in hf)


def _span(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)
