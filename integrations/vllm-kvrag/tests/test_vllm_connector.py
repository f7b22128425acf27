"""kvrag's plans on vLLM's CPU build through kvrag's connector, against vLLM's own full prefill and kvrag's
transformers path (float32)."""

from __future__ import annotations

import math
import time

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only (make test runs these tests there)")

from kvrag import InvalidRequestError, Request
from kvrag.cache.chunks import ChunkSource
from kvrag.lab.study import load_items
from kvrag.run import pipeline

FILLER = " It is one of the old towns of the coast, with narrow streets, a market on Tuesdays and a lighthouse."
TEXTS = [
    "The harbour of Velloria holds forty-two ships and is run by Mara Quell, its keeper since 2011." + FILLER * 2,
    "The river Tam floods every spring and leaves the lower fields under water until May." + FILLER * 2,
    "The archive opens at nine in the morning and closes at five, except on Sundays." + FILLER * 2,
]
Q = "Who runs the harbour of Velloria?"


def answer(kv, executor, store, question, chunks, **options):
    request = Request.of(question, chunks, **options)
    chunks = ChunkSource(kv, store).chunks(request.chunks)
    *_, final = pipeline.stream(kv, request, chunks, executor, started_at=time.perf_counter())
    return final


def test_exact_reuse_gives_vllms_own_full_prefill_and_kvrags_tokens(kv, executor, store):
    """One chunk right behind the prefix: its stored KV is exact, so the connector's answer is full prefill's."""
    through = answer(kv, executor, store, Q, TEXTS[:1], strategy="reuse", max_new_tokens=16)
    own = answer(kv, executor, store, Q, TEXTS[:1], strategy="full_prefill", max_new_tokens=16)  # no plan: vLLM alone
    hf = answer(kv, kv.executor, store, Q, TEXTS[:1], strategy="full_prefill", max_new_tokens=16)
    assert through.stats.recomputed_tokens == 0 < through.stats.context_tokens  # the whole chunk loaded
    assert through.token_ids == own.token_ids == hf.token_ids and "Mara" in through.text


def test_every_token_recomputed_is_vllms_full_prefill(kv, executor, store):
    through = answer(kv, executor, store, Q, TEXTS, strategy="full_prefill", max_new_tokens=16)
    hf = answer(kv, kv.executor, store, Q, TEXTS, strategy="full_prefill", max_new_tokens=16)
    assert through.token_ids == hf.token_ids and through.stats.recomputed_tokens == through.stats.context_tokens


@pytest.mark.parametrize("strategy", ["reuse", "reorder", "target_recompute", "target_only"])
def test_approximate_plans_give_kvrags_own_answers(kv, executor, store, strategy):
    """Stitched, re-positioned KV through the connector: the same greedy tokens as kvrag's transformers path."""
    options = dict(strategy=strategy, scores=[0.9, 0.2, 0.4], max_new_tokens=16)
    through = answer(kv, executor, store, Q, TEXTS, **options)
    hf = answer(kv, kv.executor, store, Q, TEXTS, **options)
    assert through.stats.order == hf.stats.order and through.token_ids == hf.token_ids


def test_target_recompute_agrees_with_the_transformers_path_on_study_items(kv, executor, store, capsys):
    items, _ = load_items("builtin:all", limit=3)  # 24 items: three of each built-in family
    same, largest = 0, 0.0
    for item in items:
        texts = [c.text for c in item.chunks]
        options = dict(strategy="target_recompute", target=item.target_index, max_new_tokens=16)
        request = Request.of(item.question, texts, **options)
        prefilled = kv.prefill(request)
        logp = torch.log_softmax(prefilled.prefill.logits[-1].float(), -1)
        hf = answer(kv, kv.executor, store, item.question, texts, **options)
        through = answer(kv, executor, store, item.question, texts, **options)
        same += through.token_ids == hf.token_ids
        job = executor.last_prefill
        assert job is not None and job.first_logprobs
        largest = max(largest, max(abs(lp - float(logp[t])) for t, lp in job.first_logprobs.items()))
    with capsys.disabled():
        print(f"\ntarget_recompute, vLLM against transformers: {same}/{len(items)} greedy answers equal; largest "
              f"first-token log-probability difference over vLLM's top 5: {largest:.2e}")  # fmt: skip
    assert len(items) >= 20 and same >= math.ceil(0.95 * len(items)) and largest < 1e-2


def test_a_missing_or_damaged_entry_is_computed_by_vllm(kv, executor, store):
    """The store's entry gone before scheduling, or damaged before the worker reads it: vLLM computes those
    tokens itself and the answer comes (exact: the reused chunk's tokens are then computed in place)."""
    text = "The lighthouse of Corran was built in 1853 by the engineer Ada Renn." + FILLER * 2
    question = "Who built the lighthouse of Corran?"
    own = answer(kv, executor, store, question, [text], strategy="full_prefill", max_new_tokens=12)
    for damage in ("delete", "corrupt"):
        request = Request.of(question, [text], strategy="reuse", max_new_tokens=12).with_default(None)
        chunks = ChunkSource(kv, store).chunks(request.chunks)
        run = pipeline.prefill(kv, request, chunks, executor)  # the plan is made and its entries stored
        key = run.prefill.plan.pieces[1].key
        path = store._path(key)
        if damage == "delete":
            store.delete(key)
        else:
            blob = bytearray(path.read_bytes())
            blob[-5] ^= 0xFF
            path.write_bytes(bytes(blob))
        executor.llm.reset_prefix_cache()  # else the blocks vLLM computed for the first case serve the second
        tokens = list(executor.decode(run.prefill, request.sampling))
        executor.release(run.prefill)
        assert tokens[: len(own.token_ids)] == own.token_ids, damage
        # counted as the work vLLM did: the chunk computed, not loaded (a damaged entry fails in the worker, after
        # vLLM counted it cached; the connector reports where vLLM computed from)
        assert run.prefill.recomputed_tokens == run.prefill.context_tokens, damage
        store.delete(key)


def test_plans_inside_reused_kv_are_refused_with_the_reason(kv, executor, store):
    with pytest.raises(InvalidRequestError, match="recomputes tokens inside reused KV"):
        answer(kv, executor, store, Q, TEXTS, strategy="token_select", budget=0.1, max_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="scales reused keys"):
        answer(kv, executor, store, Q, TEXTS, strategy="tempered", max_new_tokens=4)


def test_the_engine_retrieves_and_plans_here_and_answers_through_vllm(kv, executor, store_root):
    """KVRAG over the same disk store as the connector: ingestion stores each chunk's KV once; a query on the
    vLLM executor reads it from there and answers as the engine does in-process."""
    from kvrag import KVRAG
    from kvrag.cache.store import DiskStore
    from kvrag.engine.embed import Embedder

    embedder = Embedder()
    here = KVRAG(kv, embedder=embedder, store=DiskStore(store_root, "float32"), secret="")  # as the connector reads
    here.ingest(TEXTS, split=False, progress=False)
    there = KVRAG(
        kv, embedder=embedder, store=DiskStore(store_root, "float32"), index=here.index, executor=executor, secret=""
    )
    for strategy in ("target_recompute", "reuse"):
        want = here.query(Q, strategy=strategy, top_k=3, max_new_tokens=12)
        got = there.query(Q, strategy=strategy, top_k=3, max_new_tokens=12)
        assert got.token_ids == want.token_ids and got.stats.order == want.stats.order
        assert [s.id for s in got.sources] == [s.id for s in want.sources] and got.stats.chunks_encoded == 0


def test_a_tenant_executor_and_its_connector_share_one_view_of_the_store(kv, tmp_path):
    """The executor writes into its tenant's view (as the engine does); the connector configured with that
    `tenant` and `secret_file` reads it there, and a connector without the secret finds nothing usable."""
    from vllm_kvrag.connector import open_store
    from vllm_kvrag.executor import PlannedRequests

    from kvrag.cache.store import DiskStore

    secret = tmp_path / "secret"
    secret.write_bytes(b"t" * 32 + b"\n")
    planned = PlannedRequests(kv, DiskStore(tmp_path / "kv"), "tenant-a", b"t" * 32)
    assert planned.prefix_key in planned.store and list(DiskStore(tmp_path / "kv").keys()) == []
    assert len(list((tmp_path / "kv" / "ns-tenant-a").rglob("*.kv.safetensors"))) == 1
    extra = {"store": "disk", "path": str(tmp_path / "kv"), "tenant": "tenant-a"}
    salts = {
        PlannedRequests(kv, DiskStore(tmp_path / "kv"), ns, b"t" * 32 if ns else b"").tenant_salt for ns in ("a", "b")
    }
    assert len(salts) == 2 and PlannedRequests(kv, DiskStore(tmp_path / "kv")).tenant_salt is None
    for config, found in (({**extra, "secret_file": str(secret)}, True), (extra, False)):
        view = open_store(config)
        view.bind(encoder=kv.encoder_id, dtype=torch.float32, device="cpu")
        assert (view.get(planned.prefix_key) is not None) is found


def test_concurrent_queries_share_one_engine_and_each_gets_its_own_answer(kv, executor, store):
    """Threads answering at once are batched by vLLM's one engine (each step advances every request); every
    thread gets exactly the tokens it gets alone, and none waits on another's finished request."""
    from concurrent.futures import ThreadPoolExecutor

    asks = [
        (Q, dict(strategy="target_recompute", scores=[0.9, 0.2, 0.4])),
        ("When does the archive open?", dict(strategy="reuse", scores=[0.1, 0.2, 0.9])),
        ("When does the river Tam flood?", dict(strategy="target_only", scores=[0.2, 0.9, 0.1])),
        (Q, dict(strategy="full_prefill")),
    ] * 2
    alone = [answer(kv, executor, store, q, TEXTS, max_new_tokens=12, **o).token_ids for q, o in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: answer(kv, executor, store, a[0], TEXTS, max_new_tokens=12, **a[1]), asks))
    assert [a.token_ids for a in together] == alone
    assert not executor.llm.llm_engine.has_unfinished_requests() and not executor._stepper.queues


def test_attach_runs_an_engines_plans_on_vllm_over_its_own_store(kv, llm, store_root):
    """`attach` gives an engine a vLLM executor over the store it already has; the connector's config for that
    store is the one the session's engine was started with."""
    from vllm_kvrag.attach import attach, store_config
    from vllm_kvrag.executor import VLLMExecutor

    from kvrag import KVRAG
    from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
    from kvrag.engine.embed import Embedder

    disk = DiskStore(store_root, "float32")
    assert store_config(TieredStore(MemoryStore(), disk)) == {
        "store": "disk",
        "path": str(store_root),
        "storage_dtype": "float32",
    }
    assert store_config(disk.scoped("tenant-a"))["tenant"] == "tenant-a"
    assert store_config(disk.scoped("tenant-a"))["path"] == str(store_root)
    with pytest.raises(InvalidRequestError, match="disk folder or Redis"):
        store_config(MemoryStore())
    embedder = Embedder()
    here = KVRAG(kv, embedder=embedder, store=TieredStore(MemoryStore(), DiskStore(store_root, "float32")), secret="")
    here.ingest(TEXTS, split=False, progress=False)
    want = here.query(Q, strategy="target_recompute", top_k=3, max_new_tokens=12)
    there = attach(
        KVRAG(kv, embedder=embedder, store=DiskStore(store_root, "float32"), index=here.index, secret=""), llm
    )
    assert isinstance(there.executor, VLLMExecutor)
    got = there.query(Q, strategy="target_recompute", top_k=3, max_new_tokens=12)
    assert got.token_ids == want.token_ids and got.stats.chunks_encoded == 0
    assert got.stats.recomputed_tokens < got.stats.context_tokens  # the reused chunks came through the connector


def test_the_connectors_memory_tier_and_its_bad_settings(tmp_path):
    from vllm_kvrag.connector import open_store

    from kvrag.cache.store import TieredStore
    from kvrag.errors import KVRAGError

    tiered = open_store({"store": "disk", "path": str(tmp_path), "memory_bytes": 1 << 20})
    assert isinstance(tiered, TieredStore) and tiered.front.max_bytes == 1 << 20
    for bad in ("2GB", -1, True):
        with pytest.raises(KVRAGError, match="memory_bytes must be a whole number"):
            open_store({"store": "disk", "path": str(tmp_path), "memory_bytes": bad})


def test_requests_vllm_preempts_are_loaded_again_and_answer_as_they_would_unpreempted(kv, executor, store, folder):
    """An engine whose paged KV holds two of three planned requests: it admits two, runs out of blocks while they
    decode, preempts one (its blocks freed) and resumes it later, when the connector loads its stored KV again.
    Every answer is the one the roomy session engine gives the same plans."""
    from vllm import LLM, SamplingParams
    from vllm_kvrag.executor import connector_config

    asks = [
        (Q, dict(strategy="target_recompute", scores=[0.9, 0.2, 0.4])),
        ("When does the archive open?", dict(strategy="reuse", scores=[0.1, 0.2, 0.9])),
        ("When does the river Tam flood?", dict(strategy="target_recompute", scores=[0.2, 0.9, 0.1])),
    ]
    prefills = []
    for question, options in asks:  # kvrag plans (and stores what the plans read); vLLM's requests are made below
        request = Request.of(question, TEXTS, max_new_tokens=1, **options).with_default(None)
        run = pipeline.prefill(kv, request, ChunkSource(kv, store).chunks(request.chunks), executor)
        prefills.append(run.prefill)
    assert all(p.plan is not None and len(p.prompt_ids) < 320 for p in prefills)
    prompts = [{"prompt_token_ids": p.prompt_ids, "cache_salt": p.plan.salt} for p in prefills]
    params = [
        SamplingParams(
            max_tokens=160, temperature=0, ignore_eos=True, extra_args={"kv_transfer_params": p.plan.to_params()}
        )
        for p in prefills
    ]
    executor.llm.reset_prefix_cache()
    roomy = [out.outputs[0].token_ids for out in executor.llm.generate(prompts, params, use_tqdm=False)]

    block = 32
    block_bytes = kv.model.config.num_hidden_layers * 2 * kv.model.config.num_key_value_heads * block * 64 * 4
    tight = LLM(
        model=folder,
        dtype="float32",
        max_model_len=512,
        block_size=block,
        enforce_eager=True,
        kv_cache_memory_bytes=22 * block_bytes,  # two prompts of 10 blocks, not their 5 blocks of answer each
        disable_log_stats=False,  # the outputs then carry their number of preemptions
        kv_transfer_config=connector_config(
            {"store": "disk", "path": str(store.root), "storage_dtype": "float32", "unkeyed": True}
        ),
    )
    try:
        outs = tight.generate(prompts, params, use_tqdm=False)
    finally:
        tight.llm_engine.engine_core.shutdown()
    assert sum(out.metrics.num_preemptions for out in outs) >= 1
    assert [out.outputs[0].token_ids for out in outs] == roomy


def test_a_request_resumed_after_preemption_is_loaded_again_into_its_new_blocks():
    """vLLM frees a preempted request's KV and matches it again when it resumes; it then comes back among the
    cached requests, with all its blocks: the connector loads it there as it loads a new one."""
    from types import SimpleNamespace

    from vllm_kvrag.connector import KVRAGConnector
    from vllm_kvrag.plan import Piece, TransferPlan

    connector = object.__new__(KVRAGConnector)  # the scheduler side's state only
    plan = TransferPlan((Piece("ab" * 32, 0, 0, 40),), "encoder")
    ids = list(range(40))
    connector._pending = {"new": (plan, 0, 40, ids), "resumed": (plan, 0, 40, ids), "running": (plan, 0, 40, ids)}
    connector._block_size, connector._loading = 32, {}
    connector._computed_from = {"resumed": 0}  # a load that failed before the preemption: it is loaded again
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="new", block_ids=([3, 4],))],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["running", "resumed"], resumed_req_ids={"resumed"}, new_block_ids=[([9],), ([7, 8],)]
        ),
    )
    loads = connector.build_connector_meta(output).loads
    assert [(load.block_ids, load.begin, load.end) for load in loads] == [([3, 4], 0, 40), ([7, 8], 0, 40)]
    assert connector._pending == {}  # a request matched but not scheduled is matched afresh when it is

    # the worker reports the resumed request's second block as failed: vLLM computes it from token 32, and the
    # finished request says so (vLLM's own count of cached tokens would still hold the failed tokens)
    connector.update_connector_output(SimpleNamespace(invalid_block_ids={8}))
    assert connector.request_finished(SimpleNamespace(request_id="resumed"), [7, 8]) == (
        False,
        {"kvrag_computed_from": 32},
    )
    assert connector.request_finished(SimpleNamespace(request_id="new"), [3, 4]) == (False, None)
    assert connector._loading == {} and connector._computed_from == {}


def test_a_store_that_fails_while_the_worker_reads_is_a_miss_not_a_dead_worker(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from vllm_kvrag.connector import KVRAGConnector, KVRAGLoadWarning, Load
    from vllm_kvrag.plan import Piece, TransferPlan

    from kvrag.cache.store import DiskStore
    from kvrag.errors import StoreError

    class Failing(DiskStore):
        def _get(self, key):
            raise StoreError("the disk went away")

    connector = object.__new__(KVRAGConnector)  # the worker side's state only
    connector._store, connector._dtype, connector._repositioner = Failing(tmp_path), torch.float32, object()
    connector._reader, connector._block_size, connector._buffers = ThreadPoolExecutor(2), 32, {}
    plan = TransferPlan((Piece("ab" * 32, 0, 0, 40), Piece("cd" * 32, 8, 40, 24)), "encoder")
    with pytest.warns(KVRAGLoadWarning, match="the disk went away"):
        assert connector._fill(Load(plan, [0, 1], 0, 63, list(range(63))), layers=[]) == 0  # vLLM computes it all


def test_an_entry_holding_other_tokens_than_the_prompts_is_never_written(tmp_path):
    """The connector checks each entry's token ids against the prompt's, as kvrag does when it reads one: KV of
    another chunk written at a chunk's key (forged, or misplaced) is a miss, and vLLM computes those tokens."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm_kvrag.connector import KVRAGConnector, KVRAGLoadWarning, Load
    from vllm_kvrag.plan import Piece, TransferPlan

    from kvrag.cache.kv import ChunkKV
    from kvrag.cache.store import DiskStore

    store = DiskStore(tmp_path)
    store.bind(encoder="encoder", dtype=torch.float32, device="cpu")
    ids = torch.arange(100, 140)
    entry = ChunkKV(ids, torch.randn(2, 1, 40, 32), torch.randn(2, 1, 40, 32), 0, "encoder")
    store.put("ab" * 32, entry)
    connector = object.__new__(KVRAGConnector)  # the worker side's state only
    connector._store, connector._dtype, connector._repositioner = store, torch.float32, object()
    connector._reader, connector._block_size, connector._buffers = ThreadPoolExecutor(2), 32, {}
    isa = _get_attn_isa(torch.float32, 32, 32)
    layers = [(i, SimpleNamespace(isa=isa), torch.zeros(4, 1, 32, 64)) for i in range(2)]  # [blocks, H, bs, 2D]
    plan = TransferPlan((Piece("ab" * 32, 0, 0, 40),), "encoder")
    forged = [*ids.tolist()[:39], 7]
    with pytest.warns(KVRAGLoadWarning, match="other tokens than the prompt's"):
        assert connector._fill(Load(plan, [2, 3], 0, 40, forged), layers) == 0
    assert all(not cache.any() for _, _, cache in layers)  # nothing written
    assert connector._fill(Load(plan, [2, 3], 0, 40, ids.tolist()), layers) == 40
    for i, _, cache in layers:  # into blocks 2 and 3 only, each layer its own entry's keys and values (whatever
        assert not cache[:2].any()  # the layout inside a block: the values written are the entry's, all of them)
        written, stored = cache[cache != 0].sort().values, torch.cat([entry.keys[i], entry.values[i]]).flatten()
        assert torch.equal(written, stored.half().float().sort().values)  # as stored: float16


def test_the_connector_opens_redis_over_tls_with_its_password_from_a_file_never_from_the_config(tmp_path):
    """vLLM logs kv_connector_extra_config: a password comes from password_file, a URL holding one is refused,
    and store_config writes none (the TLS files pass as given)."""
    from vllm_kvrag.attach import store_config
    from vllm_kvrag.connector import open_store

    from kvrag.cache.store import RedisStore
    from kvrag.errors import InvalidRequestError, KVRAGError

    ca, password = tmp_path / "ca.pem", tmp_path / "redis-password"
    ca.write_text("not read until a connection is made")
    password.write_text("s3cret-pass\n")
    store = open_store(
        {
            "store": "redis",
            "url": "rediss://cache.internal:6380/0",
            "ssl_ca_certs": str(ca),
            "password_file": str(password),
        }
    )
    pool = store.client.connection_pool.connection_kwargs
    assert (pool["password"], pool["ssl_ca_certs"]) == ("s3cret-pass", str(ca))
    assert store.client.connection_pool.connection_class.__name__ == "SSLConnection"  # it verifies the server
    with pytest.raises(KVRAGError, match="carries a password.*password_file") as refused:
        open_store({"store": "redis", "url": "redis://:s3cret-pass@cache.internal:6379/0"})
    assert "s3cret-pass" not in str(refused.value)
    with pytest.raises(KVRAGError, match="cannot read its password_file"):
        open_store({"store": "redis", "url": "redis://cache.internal/0", "password_file": str(tmp_path / "gone")})
    engine_side = RedisStore("redis://:s3cret-pass@cache.internal:6380/0", ssl=True, ssl_ca_certs=str(ca))
    with pytest.raises(InvalidRequestError, match="password_file="):
        store_config(engine_side)
    config = store_config(engine_side, password_file=str(password))
    assert "s3cret-pass" not in repr(config) and config["url"] == "rediss://cache.internal:6380/0"
    assert (config["password_file"], config["ssl_ca_certs"]) == (str(password), str(ca))
    reopened = open_store(config).client.connection_pool.connection_kwargs
    assert (reopened["password"], reopened["ssl_ca_certs"]) == ("s3cret-pass", str(ca))


def test_the_bench_tables_show_the_medians_and_the_paired_ratio_not_the_runs():
    from vllm_kvrag.bench import FLOOR, PAIRED, _ttft_line, markdown

    row = {
        "context_tokens": 4129,
        "vllm full_prefill": 12.5,
        FLOOR: 0.7,
        "connector target_recompute": 0.8,
        PAIRED: 1.14,
        "runs": {FLOOR: [0.7, 0.71], "connector target_recompute": [0.8, 0.79]},
    }
    table = markdown({"threads": 2, "storage_dtype": "float16", "ttft": [row], "throughput": []})
    header, _, line = table.splitlines()[2:5]
    assert header == f"| context tokens | vllm full_prefill | {FLOOR} | connector target_recompute | {PAIRED} |"
    assert line == "| 4,129 | 12.500 | 0.700 | 0.800 | 1.140 |"
    assert _ttft_line(row) == (
        f"4129 context tokens: vllm full_prefill 12.500 s, {FLOOR} 0.700 s, connector target_recompute 0.800 s, "
        f"{PAIRED} 1.140"
    )



def test_the_connector_writes_straight_into_the_blocks_only_where_that_is_what_vllms_op_writes():
    """The layout check: kvrag's paged write against vLLM's CPU write op on a scratch cache. On this backend keys are
    kept transposed (D rows of block_size slots a head), and the direct path is taken; a quantized cache, or a
    scale, keeps vLLM's op."""
    from types import SimpleNamespace

    from vllm_kvrag import direct
    from vllm_kvrag.connector import KVRAGConnector

    from kvrag.cpu import cpaged

    def layer(kv_dtype="auto", scale=1.0):
        impl = SimpleNamespace(kv_cache_dtype=kv_dtype)
        return SimpleNamespace(isa="vec", _k_scale_float=scale, _v_scale_float=1.0, impl=impl)

    connector = object.__new__(KVRAGConnector)
    connector._layouts, connector._block_size = {}, 32
    if cpaged._paged_library() is None:
        assert direct.layout(connector, layer(), torch.zeros(4, 3, 32, 128)) is None
        return
    for dtype in (torch.float32, torch.bfloat16):
        assert direct.layout(connector, layer(), torch.zeros(4, 3, 32, 128, dtype=dtype)) is True
    assert direct.layout(connector, layer(kv_dtype="fp8"), torch.zeros(4, 3, 32, 128)) is None
    assert direct.layout(connector, layer(scale=0.5), torch.zeros(4, 3, 32, 128)) is None
