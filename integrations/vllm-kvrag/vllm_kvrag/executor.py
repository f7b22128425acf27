"""VLLMExecutor: kvrag's executor seam over a vLLM engine with kvrag's connector.

kvrag retrieves, picks and plans; this executor turns the plan's job into one vLLM request: the prompt's
token ids, and a transfer plan (`vllm_kvrag.plan`) naming the stored entries that fill its head (the
prefix, then the reused chunks in stitched order). vLLM computes the rest (the recomputed chunks and the
suffix) and decodes; tokens stream back as vLLM's engine steps produce them.

Only plans whose recomputed set is the prompt's tail run here (`reuse`, `reorder`, `target_recompute`,
`attention_select`, `insert_full_kv`, `target_only`, the full-prefill ones): vLLM computes a prompt's
tail, never tokens inside reused KV. Others are refused with the reason.
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from kvrag.cache.chunks import ChunkSource
from kvrag.cache.kv import ChunkKV, chunk_key
from kvrag.cache.store import KVStore
from kvrag.errors import InvalidRequestError
from kvrag.run.executor import Job, StoredChunk
from kvrag.run.generate import Sampling
from kvrag.timing import Phases
from vllm_kvrag.plan import Piece, TransferPlan

if TYPE_CHECKING:
    from kvrag.kvmodel import KVModel

_ids = itertools.count()


@dataclass(slots=True)
class VLLMPrefill:
    """A request ready for vLLM: its prompt and transfer plan (vLLM runs prefill and decoding together)."""

    prompt_ids: list[int]
    plan: TransferPlan | None  # None: vLLM computes the whole prompt
    next_position: int  # prompt tokens
    recomputed_tokens: int  # context tokens vLLM computes (the plan's, plus what block alignment leaves over)
    context_tokens: int = 0  # the prompt's context tokens (the chunks')
    request_id: str = ""
    first_logprobs: dict[int, float] | None = None  # the first token's top log-probabilities, when asked for
    logits: Any = None  # vLLM returns tokens, not logits
    cache: Any = None


class PlannedRequests:
    """What both vLLM executors share: a job becomes a prompt and a transfer plan, its entries in the store.

    The connector reads the entries itself, so kvrag hands over the stored ones unread (`reads_store`).
    """

    reads_store = True

    def __init__(self, kvmodel: KVModel, store: KVStore, namespace: str = "", secret: bytes = b"") -> None:
        # a tenant's view of the store, as its engine and the connector (extra config `tenant`) see it
        store = store.view_of(namespace)
        self.kvmodel, self.store = kvmodel, store
        self.last_prefill: VLLMPrefill | None = None
        self.source = ChunkSource(kvmodel, store, namespace, secret)  # binds the store to kvmodel's encoder
        prefix = kvmodel.prefix
        self.prefix_key = chunk_key(kvmodel.fingerprint.digest, [], kvmodel.layout.prefix_ids, salt="prefix")
        self._prefix = ChunkKV(prefix.token_ids, prefix.keys, prefix.values, 0, kvmodel.encoder_id)
        self._store_prefix()
        if self.prefix_key not in self.store:
            raise InvalidRequestError(
                "vLLM's connector starts every planned prompt from the prompt prefix's KV in the store, and this "
                "store is open read-only and lacks it: open the engine's store writable once (KVRAG.load(path) "
                "without read_only; on the command line, `kvrag ask --backend vllm` does), so it is stored"
            )

    def _store_prefix(self) -> None:
        """The prefix's entry, stored when it is not (at start, and again if `kvrag gc` removed it)."""
        if self.prefix_key not in self.store:
            self.store.put(self.prefix_key, self._prefix)

    def prefill(self, job: Job, *, phases: Phases | None = None, pooled: bool = False) -> VLLMPrefill:
        self.last_prefill = self._prefill(job)
        return self.last_prefill

    def _prefill(self, job: Job) -> VLLMPrefill:
        kv = self.kvmodel
        ids = kv.prompt_of(job.chunk_ids, job.suffix_ids)
        if job.full_prefill:
            return VLLMPrefill(ids, None, len(ids), job.context_tokens, job.context_tokens)
        reused = _reused_head(job)
        self._store_prefix()
        pieces = [Piece(self.prefix_key, 0, 0, len(kv.prefix))]
        at = len(kv.prefix)
        for ids_c, chunk in zip(job.chunk_ids[:reused], job.chunks[:reused]):
            key = chunk.key if isinstance(chunk, StoredChunk) else self._entry(ids_c, chunk)
            pieces.append(Piece(key, chunk.start, at, len(chunk)))
            at += len(chunk)
        plan = TransferPlan(tuple(pieces), kv.encoder_id)
        loaded = min(plan.reused, len(ids) - 1)  # the connector leaves the last prompt token to compute
        recomputed = job.context_tokens - max(0, loaded - len(kv.prefix))
        return VLLMPrefill(ids, plan, len(ids), recomputed, job.context_tokens)

    @property
    def tenant_salt(self) -> str | None:
        """vLLM's `cache_salt` for a tenant's exact prompts (none for the shared namespace): tenants never share
        a cached block, so vLLM's prefix cache carries no timing channel between them. Derived with the
        tenant's key function, so it is unguessable under a secret. (A planned prompt's salt is its plan's,
        whose keys are the tenant's already.)"""
        if not self.source.namespace and not self.source.secret:
            return None
        return "kvrag-tenant-" + self.source.key([])[:32]

    # -- entries ----------------------------------------------------------------------------------------

    def _entry(self, ids: list[int], chunk: ChunkKV) -> str:
        """The store key holding this chunk's KV exactly as the plan uses it (stored now if it is not)."""
        key = self.source.key(ids)
        if chunk.start != len(self.kvmodel.prefix) or chunk.behind:
            # replaced KV (a slice of a full prefill) or KV encoded in its document's context: an entry of its own,
            # keyed by where it was encoded and what it was encoded behind
            key = chunk_key(
                self.kvmodel.fingerprint.digest,
                [chunk.start],
                ids,
                salt=f"{self.source.namespace}/at/{chunk.behind}",
                secret=self.source.secret,
            )
        if key not in self.store:
            self.store.put(key, chunk)
        return key


class VLLMExecutor(PlannedRequests):
    """Runs kvrag jobs on a vLLM engine (`vllm.LLM`) whose KV connector is `vllm_kvrag.connector.KVRAGConnector`.

    Args:
        kvmodel: the kvrag model whose chunk KV is stored (the same weights vLLM serves).
        llm: the vLLM engine, made with `kv_transfer_config=connector_config(...)`.
        store: the store the connector reads (a DiskStore or RedisStore, the engine's own when shared).
        namespace: the engine's namespace (it enters every chunk's key, and the store is that tenant's view:
            give the connector the same `tenant` in its extra config).
        secret: the engine's tenant secret (the connector's `secret_file` holds the same).
        logprobs: keep the first token's top-k log-probabilities on each prefill (comparisons).
    """

    def __init__(
        self,
        kvmodel: KVModel,
        llm: Any,
        store: KVStore,
        namespace: str = "",
        *,
        secret: bytes = b"",
        logprobs: int = 0,
    ) -> None:
        super().__init__(kvmodel, store, namespace, secret)
        self.llm, self.logprobs = llm, logprobs
        self._stepper = _Stepper(llm.llm_engine)

    def decode(self, prefill: VLLMPrefill, sampling: Sampling) -> Iterator[int]:  # type: ignore[override]
        from vllm import SamplingParams

        prefill.request_id = f"kvrag-{next(_ids)}"
        params = SamplingParams(
            max_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            logprobs=self.logprobs or None,
            extra_args={"kv_transfer_params": prefill.plan.to_params()} if prefill.plan else None,
        )
        prompt: dict[str, Any] = {"prompt_token_ids": prefill.prompt_ids}
        if prefill.plan is not None:
            prompt["cache_salt"] = prefill.plan.salt  # approximate KV never meets an exact prompt's blocks
        elif self.tenant_salt:
            prompt["cache_salt"] = self.tenant_salt
        stepper = self._stepper
        stepper.add(prefill.request_id, prompt, params)
        sent, counted, prefix = 0, False, len(self.kvmodel.prefix)
        while True:
            out = stepper.next(prefill.request_id)
            tokens = out.outputs[0].token_ids
            if not counted:
                count_cached(prefill, getattr(out, "num_cached_tokens", None), prefix)
                counted = True
            if self.logprobs and prefill.first_logprobs is None and out.outputs[0].logprobs:
                first = out.outputs[0].logprobs[0]
                prefill.first_logprobs = {int(t): float(lp.logprob) for t, lp in first.items()}
            yield from tokens[sent:]
            sent = len(tokens)
            if out.finished:
                stepper.forget(prefill.request_id)
                computed_from = (getattr(out, "kv_transfer_params", None) or {}).get("kvrag_computed_from")
                if computed_from is not None:  # a load failed in the worker: vLLM computed from there
                    count_cached(prefill, min(int(computed_from), getattr(out, "num_cached_tokens", 0) or 0), prefix)
                return

    def release(self, prefill: VLLMPrefill) -> None:
        if prefill.request_id:
            self._stepper.abort(prefill.request_id)


def count_cached(prefill: VLLMPrefill, cached: int | None, prefix: int) -> None:
    """Make the prefill's recomputed count vLLM's own: the context tokens it did not take from a cache (the
    connector's load, or its prefix cache; `cached` is vLLM's `num_cached_tokens`, None when not reported). A
    plan whose entries were gone is then counted as the work vLLM did, not as the plan meant; one whose load failed
    in the worker (an entry damaged by then) is counted again when the request finishes, from where the connector
    says vLLM computed (`kvrag_computed_from`, its finished request's kv_transfer_params)."""
    if prefill.plan is None or cached is None:
        return
    context = prefill.context_tokens
    prefill.recomputed_tokens = context - max(0, min(int(cached), prefix + context) - prefix)


class _Stepper:
    """One vLLM engine stepped for many threads at once (continuous batching across kvrag's concurrent queries).

    A thread that wants its request's next output and finds none steps the engine itself, under the lock, and
    hands every request's output to that request's queue: each step advances all requests in flight, and no
    thread's output is lost to another. vLLM's outputs are cumulative, so a request reads only its latest.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.queues: dict[str, queue.SimpleQueue[Any]] = {}

    def add(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        with self.lock:
            self.queues[request_id] = queue.SimpleQueue()
            self.engine.add_request(request_id, prompt, params)

    def next(self, request_id: str) -> Any:
        mine = self.queues[request_id]
        while True:
            try:
                return mine.get_nowait()
            except queue.Empty:
                pass
            with self.lock:
                if not mine.empty():  # another thread's step brought it while this one waited for the lock
                    continue
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"vLLM's engine holds no unfinished request, and {request_id} never finished")
                for out in self.engine.step():
                    found = self.queues.get(out.request_id)
                    if found is not None:
                        found.put(out)

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.queues.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request a reader left early (a stop string, a closed stream); a finished one is only forgotten."""
        with self.lock:
            if self.queues.pop(request_id, None) is not None and self.engine.has_unfinished_requests():
                self.engine.abort_request([request_id])


def _reused_head(job: Job) -> int:
    """How many of the job's chunks keep their stored KV: all before the first recomputed one, which with every
    later chunk must be recomputed whole (vLLM computes a prompt's tail, nothing inside reused KV)."""
    n = len(job.chunks)
    recomputed = sorted(job.recompute)
    head = recomputed[0] if recomputed else n
    whole = all(int(job.recompute[c].numel()) == len(job.chunk_ids[c]) for c in recomputed)
    if recomputed != list(range(head, n)) or not whole:
        raise InvalidRequestError(
            "this plan recomputes tokens inside reused KV (chunk positions "
            f"{recomputed} of {n}, in part or out of the prompt's tail); vLLM computes only a prompt's tail: run "
            "it on kvrag's transformers executor, or use reuse, reorder, target_recompute or target_only"
        )
    if job.key_scale:
        raise InvalidRequestError(
            "this plan scales reused keys (a tempered strategy); vLLM's attention takes no per-chunk scale: run it on "
            "kvrag's transformers executor"
        )
    return head


def connector_config(store: dict[str, Any]) -> Any:
    """vLLM's KVTransferConfig that loads kvrag's connector over `store` (the connector's extra config)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KVRAGConnector",
        kv_connector_module_path="vllm_kvrag.connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=store,
    )
