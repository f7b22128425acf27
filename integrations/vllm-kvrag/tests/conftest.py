"""One vLLM engine (CPU build, float32) with kvrag's connector over a disk store, shared by the tests.

The test modules skip where vLLM is not installed: `make test` runs them in their own venv (.venv-vllm)."""

from __future__ import annotations

import pytest

KV_CACHE_BYTES = 1 << 30  # the paged KV of the in-process engine and the server


@pytest.fixture(scope="session")
def folder():
    from kvrag.model.catalog import convert_default

    return str(convert_default()[0])


@pytest.fixture(scope="session")
def store_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="session")
def kv(folder):
    from kvrag import KVModel

    return KVModel.from_pretrained(folder, dtype="float32", decode_weights="model")  # the model's own tokens, as vLLM's


@pytest.fixture(scope="session")
def store(store_root):
    from kvrag.cache.store import DiskStore

    return DiskStore(store_root, "float32")


@pytest.fixture(scope="session")
def llm(folder, store_root):
    from vllm import LLM
    from vllm_kvrag.executor import connector_config

    engine = LLM(
        model=folder,
        dtype="float32",
        max_model_len=4096,
        block_size=32,  # the CPU backend's smallest: what alignment leaves over of a reused head is computed
        enforce_eager=True,
        # the paged KV's size, given: on the CPU backend a share (gpu_memory_utilization) is of the first NUMA node's
        # memory less the worker's own, which on a machine with a small node leaves too little for one request
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        # the tests write entries through bare stores, unkeyed (an engine keys with the user's kvrag key by default)
        kv_transfer_config=connector_config(
            {"store": "disk", "path": str(store_root), "storage_dtype": "float32", "unkeyed": True}
        ),
    )
    yield engine
    # Shut down here, while pytest still captures: left to the interpreter's exit, the engine's shutdown logs
    # through vLLM's handler, which holds pytest's captured stdout, closed by then ("--- Logging error ---").
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def executor(kv, llm, store):
    from vllm_kvrag.executor import VLLMExecutor

    return VLLMExecutor(kv, llm, store, logprobs=5)


def pytest_unconfigure(config):
    """vLLM's log handlers hold the stream they found when vLLM was first imported: pytest's captured stdout, which
    pytest closes at its end. Whatever vLLM still logs at the interpreter's exit (an engine a test left running,
    its worker's shutdown) goes to the real stderr instead of printing "--- Logging error ---"."""
    import logging
    import sys

    for name in list(logging.root.manager.loggerDict):
        logger = logging.getLogger(name) if name.startswith("vllm") else None
        for handler in logger.handlers if logger is not None else ():
            if type(handler) is logging.StreamHandler and handler.stream not in (sys.__stdout__, sys.__stderr__):
                handler.setStream(sys.__stderr__)
