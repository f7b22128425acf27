"""Loading layer by layer (`"layerwise": true`): the protocol on its own, and end to end on vLLM's CPU build, where
each attention layer waits in `wait_for_layer_load` for its own layer's write only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only (make test runs these tests there)")

from test_vllm_connector import TEXTS, answer  # noqa: E402
from vllm_kvrag.layerwise import LayerPipeline

ASKS = [
    ("Who runs the harbour of Velloria?", dict(strategy="target_recompute", scores=[0.9, 0.2, 0.4])),
    ("When does the archive open?", dict(strategy="reuse", scores=[0.1, 0.2, 0.9])),
    ("When does the river Tam flood?", dict(strategy="target_recompute", scores=[0.2, 0.9, 0.1])),
]


def test_each_layer_waits_for_its_own_write_only():
    pipeline = LayerPipeline([0, 1, 2, 3], torch.device("cpu"))
    gates = {i: threading.Event() for i in range(4)}
    log: list[str] = []

    def write(i: int) -> None:
        gates[i].wait(5)
        log.append(f"write {i}")

    pipeline.start(write, prepare=lambda: log.append("prepare"))
    gates[0].set()
    pipeline.wait(0)  # layer 0 is written, layer 1 held back: the forward's layer 0 goes on
    log.append("layer 0 runs")
    assert pipeline.written == [0]
    for i in (1, 2, 3):
        gates[i].set()
        pipeline.wait(i)
        log.append(f"layer {i} runs")
    pipeline.wait(7)  # a layer the pipeline does not load: nothing to wait for
    assert pipeline.join() is None
    assert log == ["prepare", "write 0", "layer 0 runs", "write 1", "layer 1 runs", "write 2", "layer 2 runs",
                   "write 3", "layer 3 runs"]  # fmt: skip


def test_a_failed_write_never_leaves_the_forward_waiting_and_is_reported():
    pipeline = LayerPipeline([0, 1, 2], torch.device("cpu"))

    def write(i: int) -> None:
        if i == 1:
            raise OSError("the store went away")

    pipeline.start(write)
    started = time.perf_counter()
    for i in (0, 1, 2):
        pipeline.wait(i)
    assert time.perf_counter() - started < 5
    error = pipeline.join()
    assert isinstance(error, OSError) and pipeline.written == [0]


def test_the_layerwise_setting_is_a_boolean():
    from vllm_kvrag.connector import KVRAGConnector, _layerwise_setting

    from kvrag.errors import KVRAGError

    assert _layerwise_setting({}) is None and _layerwise_setting({"layerwise": False}) is False
    with pytest.raises(KVRAGError, match="layerwise must be true or false, got 'yes'"):
        _layerwise_setting({"layerwise": "yes"})
    # a CUDA graph would skip the waits inside the forward: vLLM is asked for piecewise graphs unless it is off
    assert KVRAGConnector.requires_piecewise_for_cudagraph({}) is True
    assert KVRAGConnector.requires_piecewise_for_cudagraph({"layerwise": False}) is False


# Run in a process of its own: the engine runs in-process there (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that its
# connector's waits can be seen, and vLLM's CPU worker pins that process's threads, not the test session's.
_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM
    from vllm_kvrag import layerwise
    from vllm_kvrag.executor import VLLMExecutor, connector_config
    from kvrag import KVModel, Request
    from kvrag.cache.chunks import ChunkSource
    from kvrag.cache.store import DiskStore
    from kvrag.run import pipeline

    folder, root, asks, texts = json.loads(sys.argv[1])
    waits = []  # (layer, written before the wait returned) for every wait of a pipeline that loads something
    original = layerwise.LayerPipeline.wait

    def wait(self, layer):
        original(self, layer)
        if layer in self._ready:
            waits.append((layer, layer in self.written))

    layerwise.LayerPipeline.wait = wait
    extra = {"store": "disk", "path": root, "storage_dtype": "float32", "unkeyed": True, "layerwise": True}
    llm = LLM(model=folder, dtype="float32", max_model_len=4096, block_size=32, enforce_eager=True,
              kv_cache_memory_bytes=1 << 29, kv_transfer_config=connector_config(extra))
    kv = KVModel.from_pretrained(folder, dtype="float32", decode_weights="model")
    store = DiskStore(root, "float32")
    executor = VLLMExecutor(kv, llm, store)
    out = []
    for question, options in asks:
        request = Request.of(question, texts, max_new_tokens=16, **options)
        chunks = ChunkSource(kv, store).chunks(request.chunks)
        *_, final = pipeline.stream(kv, request, chunks, executor, started_at=time.perf_counter())
        out.append(final.token_ids)
    print("RESULT " + json.dumps({"tokens": out, "waits": waits, "layers": kv.model.config.num_hidden_layers}))
    """
)


def test_layer_by_layer_on_vllm_gives_the_same_tokens_and_waits_for_each_layer(kv, executor, store, folder):
    own = [  # the session engine: every layer written before the forward
        answer(kv, executor, store, question, TEXTS, max_new_tokens=16, **options).token_ids
        for question, options in ASKS
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    args = json.dumps([folder, str(store.root), ASKS, TEXTS])
    done = subprocess.run([sys.executable, "-c", _SCRIPT, args], env=env, capture_output=True, text=True, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, done.stderr[-3000:]
    result = json.loads(line.removeprefix("RESULT "))
    assert result["tokens"] == own
    layers = result["layers"]
    waits = result["waits"]
    # one planned prefill a request, each layer waited for in order, each written before its wait returned
    assert len(waits) == len(ASKS) * layers
    assert [w[0] for w in waits] == list(range(layers)) * len(ASKS) and all(w[1] for w in waits)


def _script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvrag_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_7b_bench_computes_over_cached_kv_what_its_full_prefill_computes():
    """scripts/bench_7b.py times a model of its own (torch alone): its forward of the last tokens over the earlier
    tokens' cached KV is its full prefill's, so the two timings are of the same work's two ways."""
    bench = _script("bench_7b")
    model = bench.Model(bench.SHAPES["tiny"], torch.device("cpu"), torch.float32)
    ids = torch.randint(0, model.vocab, (96,), generator=torch.Generator().manual_seed(0))

    def cache():
        return [torch.zeros(2, model.kv_heads, len(ids), model.head_dim) for _ in range(model.layers)]

    full = model.forward(ids, 0, cache())
    split = cache()
    model.forward(ids[:60], 0, [c[:, :, :60] for c in split])
    waited = []
    last = model.forward(ids[60:], 60, split, wait=waited.append)
    assert waited == list(range(model.layers))
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)


def test_the_7b_bench_runs_with_torch_alone():
    done = subprocess.run(
        [sys.executable, str(_script("bench_7b").__file__), "--device", "cpu", "--shape", "tiny", "--context", "512",
         "--target", "64", "--runs", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[1].startswith("full prefill: ") and lines[-1].startswith("target_recompute, KV loaded layer by layer")


def _bare_connector(store, layerwise=None):
    """A connector's worker-side state only, over `store`, for a tiny Llama's rotation (head size 32)."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import LlamaConfig
    from vllm_kvrag.connector import KVRAGConnector

    from kvrag.model.rope import Repositioner, rotary_of_config

    config = LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2)
    connector = object.__new__(KVRAGConnector)
    connector._store, connector._dtype = store, torch.float32
    connector._repositioner = Repositioner(rotary=rotary_of_config(config))
    connector._reader, connector._block_size, connector._buffers = ThreadPoolExecutor(2), 16, {}
    connector._shifts, connector._errors, connector._tp = {}, set(), (0, 1)
    connector._layerwise, connector._pipeline, connector._layer_of = layerwise, None, {}
    return connector


def test_layer_by_layer_writes_a_gpu_layout_cache_as_the_whole_step_load_does(tmp_path):
    """On GPU-backend caches (here on CPU): the layered load, keys rotated where the cache is, leaves the caches bit
    for bit as the whole-step load does; a piece whose entry holds other tokens stops it there, the pieces before it
    written, its blocks and the rest load errors."""
    from vllm_kvrag import layered
    from vllm_kvrag.connector import KVRAGLoadWarning, Load
    from vllm_kvrag.plan import Piece, TransferPlan

    from kvrag.cache.kv import ChunkKV
    from kvrag.cache.store import DiskStore

    store = DiskStore(tmp_path, "float16")
    store.bind(encoder="encoder", dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    pieces, ids = [], []
    for n, (start, position, length) in enumerate([(0, 0, 20), (20, 45, 30), (20, 20, 25)]):  # one moved by 25
        tokens = torch.arange(1000 * n, 1000 * n + length)
        store.put(f"{n:02d}" * 32, ChunkKV(tokens, torch.randn(2, 2, length, 32, generator=g),
                                           torch.randn(2, 2, length, 32, generator=g), start, "encoder"))  # fmt: skip
        pieces.append(Piece(f"{n:02d}" * 32, start, position, length))
        ids.append(tokens.tolist())
    order = [pieces[0], pieces[2], pieces[1]]  # in the prompt: 0..20, 20..45, 45..75
    plan = TransferPlan(tuple(order), "encoder")
    prompt = ids[0] + ids[2] + ids[1]
    blocks = [5, 2, 7, 0, 3]

    def caches():
        return [(i, object(), torch.zeros(8, 2, 16, 64)) for i in range(2)]  # no isa: a GPU backend's layout

    whole, piped = caches(), caches()
    connector = _bare_connector(store)
    assert connector._fill(Load(plan, blocks, 0, 75, prompt), whole) == 75
    pipeline = layered.start(connector, [Load(plan, blocks, 0, 75, prompt)], piped)
    for i in (0, 1):
        pipeline.wait(i)
    layered.finish(connector, pipeline, [])
    assert connector._errors == set() and pipeline.written == [0, 1]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(whole, piped)) and whole[0][2].any()

    forged = prompt[:30] + [7] + prompt[31:]  # the second piece (tokens 20..45) is not what its entry holds
    piped = caches()
    with pytest.warns(KVRAGLoadWarning, match="other tokens than the prompt's"):
        pipeline = layered.start(connector, [Load(plan, blocks, 0, 75, forged)], piped)
        layered.finish(connector, pipeline, [])
    assert connector._errors == {blocks[1], blocks[2], blocks[3], blocks[4]}  # tokens 20.. : blocks 1 to 4
    first = [b * 16 + t % 16 for t in range(20) for b in [blocks[t // 16]]]
    for (_, _, a), (_, _, b) in zip(whole, piped):
        assert torch.equal(a.transpose(1, 2).reshape(-1, 2, 64)[first], b.transpose(1, 2).reshape(-1, 2, 64)[first])
        rest = torch.ones(8 * 16, dtype=torch.bool)
        rest[first] = False
        assert not b.transpose(1, 2).reshape(-1, 2, 64)[rest].any()  # nothing of the forged piece or after it
