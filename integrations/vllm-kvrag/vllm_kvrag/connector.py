"""KVRAGConnector: vLLM's KV connector that fills a prompt's head with kvrag's stored chunk KV, re-positioned.

Loaded by vLLM through `kv_connector_module_path="vllm_kvrag.connector"`; no patch to vLLM. For a request
whose `kv_transfer_params` carry a kvrag plan (`vllm_kvrag.plan`), the scheduler side reports the
plan's pieces (the prefix, then the reused chunks) as matched tokens, as far as their entries are in the
store and block alignment allows; vLLM computes the rest (the recomputed chunks, the suffix) and decodes.
The worker side reads each piece's entry from kvrag's store (the same keys and format: disk or Redis),
rotates its keys from the position they were encoded at to their place with kvrag's own re-positioning,
and writes keys and values into the request's blocks with vLLM's own cache-write op. It never saves
anything: kvrag's exact entries are kvrag's to write. An entry that has gone or is damaged by the time it
is read is reported as a load error, and vLLM recomputes those tokens (`kv_load_failure_policy="recompute"`).

Configuration (`KVTransferConfig.kv_connector_extra_config`): `store` ("disk" or "redis"), `path` (disk),
`url` and `namespace` (redis; never a password in the URL, since vLLM logs this config: `password_file` names a
file holding it; TLS with a rediss:// URL or `ssl`, and `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`),
`storage_dtype` (as the entries were written, default float16), and for a
tenant: `tenant` (the engine's namespace: the connector reads that tenant's view of the store, as the
engine writes it) and `secret_file` (a file holding the secret its entries are checksummed with; by default the
user's kvrag key, `kvrag.cache.secret`, as the engine's default; `unkeyed: true` for entries written with none);
`memory_bytes` (default 0: none) keeps entries, once read and verified, decoded (in their storage dtype) in
the worker's memory, at most that many bytes, least recently used out first; `layerwise` (true or false; not
given: true where the caches are on a GPU) loads layer by layer beside the forward.

On vLLM's GPU attention backends (FlashAttention, FlashInfer, Triton) the cache's content is a token's key then its
value, in whichever of vLLM's KVCacheLayouts the strides say; the connector writes it with an indexed copy on the
cache's device (`vllm_kvrag.layout.scatter`), each tensor-parallel worker its own share of the kv heads, and refuses
an fp8 or unknown cache by name (vLLM then computes the tokens). This is checked on CPU against the caches vLLM's
own allocator lays out, not yet inside vLLM on a GPU.

Where kvrag's paged-write kernel builds (`kvrag.cpu.paged_write`) and writes what vLLM's own write op writes
(checked once a cache layout, on a scratch cache, before the first load), reader threads read each entry, verify
it, check its token ids against the prompt's, and write it straight into the request's blocks (`direct`). Elsewhere
a load reads its pieces a group of about _GROUP_TOKENS tokens at a time into a buffer (keys rotated, in the model's
dtype), and writes each group with one call of vLLM's write op a layer, while the readers fill the next group's
buffer. With `layerwise` (extra config; by default where the caches are on a GPU) the step's load runs beside the
forward instead, a layer at a time, and each attention layer waits for its own layer in `wait_for_layer_load`
(`layered`, `layerwise`).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvrag.cache.kv import ChunkKV
from kvrag.errors import KVRAGError
from kvrag.model.loading import check_architecture
from kvrag.model.rope import Repositioner, rotary_of_config
from vllm_kvrag import direct, layered
from vllm_kvrag.config import open_store
from vllm_kvrag.layerwise import LayerPipeline
from vllm_kvrag.layout import kv_heads_of, layout_of, tensor_parallel
from vllm_kvrag.paged import (
    _LAYER,
    KVRAGLoadWarning,
    _missed,
    _paged_layers,
    _use_worker_cpus,
    _write,
)
from vllm_kvrag.plan import Piece, TransferPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_GROUP_TOKENS = 1024  # tokens read into one buffer, then written with one call a layer (two buffers: ~95 MB here)
_READERS = 2  # threads reading and verifying entries, and rotating their keys


@dataclass(slots=True)
class Load:
    """One request's tokens [begin, end) to fill from the store, into its blocks."""

    plan: TransferPlan
    block_ids: list[int]
    begin: int
    end: int
    token_ids: list[int]  # the prompt's ids [begin, end): an entry holding other tokens is never written


Span = tuple[Piece, int, int, list[int]]  # a piece, the tokens [lo, hi) of it to load, the prompt's ids there


def _groups(spans: list[Span]) -> list[list[Span]]:
    """Consecutive spans in groups of about _GROUP_TOKENS tokens (a piece is never split; one at least a group)."""
    groups: list[list[Span]] = []
    total = _GROUP_TOKENS
    for span in spans:
        if total >= _GROUP_TOKENS:
            groups.append([])
            total = 0
        groups[-1].append(span)
        total += span[2] - span[1]
    return groups


def _layerwise_setting(extra: dict[str, Any]) -> bool | None:
    """The extra config's `layerwise`: True or False, or None (not given: on where the caches are on a GPU)."""
    value = extra.get("layerwise")
    if value is not None and not isinstance(value, bool):
        raise KVRAGError(f"the kvrag connector's layerwise must be true or false, got {value!r}")
    return value


@dataclass
class KVRAGConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)


class LoadSeam:
    """The worker side as the connector's write paths (`direct`, `layered`) see it: what they read (the block size,
    the dtype, the reader threads, the repositioner, the checked cache layouts, a load's spans, an entry, a worker's
    kv heads, a shift's angles) and the one thing they change (the step's load errors). Read when used: nothing of
    the connector is copied."""

    def __init__(self, connector: KVRAGConnector) -> None:
        self._connector = connector

    @property
    def block_size(self) -> int:
        return self._connector._block_size

    @property
    def dtype(self) -> torch.dtype:
        return self._connector._dtype

    @property
    def reader(self) -> ThreadPoolExecutor:
        return self._connector._reader

    @property
    def repositioner(self) -> Repositioner | None:
        return self._connector._repositioner

    @property
    def layouts(self) -> dict[tuple[Any, ...], bool | None]:
        return self._connector._layouts  # a cache layout -> keys transposed, or None (checked once a layout)

    def spans(self, load: Load) -> list[Span]:
        return self._connector._spans(load)

    def entry(self, piece: Piece, lo: int, hi: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | str:
        return self._connector._entry(piece, lo, hi, ids)

    def heads(self, stored: int, held: int) -> slice:
        return self._connector._heads(stored, held)

    def worker_part(
        self, entry: tuple[torch.Tensor, torch.Tensor], first: int, layers: int, held: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor] | str:
        """Layers [first, first + layers) of an entry's keys and values, this worker's kv heads of them (views);
        or, where the entry does not hold those (fewer layers, other heads, another head size), the reason a load
        reports. The one check of an entry's shape against a worker's cache."""
        heads = self.heads(entry[0].shape[1], held)
        keys, values = entry[0][first : first + layers, heads], entry[1][first : first + layers, heads]
        if len(keys) != layers or keys.shape[1] != held or keys.shape[-1] != width:
            return (f" (its KV is {tuple(entry[0].shape)}; this worker's cache takes layers {first}.."
                    f"{first + layers - 1} of {held} heads x {width})")
        return keys, values

    def angles(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._connector._angles(delta)

    def load_errors(self, blocks: set[int]) -> None:
        """Blocks whose KV could not be loaded this step (vLLM computes them)."""
        self._connector._errors |= blocks


class KVRAGConnector(KVConnectorBase_V1):
    """Fills the head of a planned request's prompt with kvrag's stored KV (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        hf_config = vllm_config.model_config.hf_config
        check_architecture(hf_config)  # a model kvrag refuses is refused here, with the same message
        self._block_size = vllm_config.cache_config.block_size
        self._store = open_store(dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        self._dtype = vllm_config.model_config.dtype
        # scheduler: request id -> plan, begin, end, the prompt's ids [begin, end)
        self._pending: dict[str, tuple[TransferPlan, int, int, list[int]]] = {}
        # scheduler: request id -> the blocks, begin and end of its last load, until it finishes; and where vLLM
        # computes from because a load of it failed (reported back in the finished request's kv_transfer_params)
        self._loading: dict[str, tuple[list[int], int, int]] = {}
        self._computed_from: dict[str, int] = {}
        self._errors: set[int] = set()  # worker: blocks whose KV could not be loaded this step
        self._repositioner: Repositioner | None = None
        if role == KVConnectorRole.WORKER:
            self._repositioner = Repositioner(rotary=rotary_of_config(hf_config))
            self._reader = ThreadPoolExecutor(_READERS, thread_name_prefix="kvrag-read", initializer=_use_worker_cpus)
            self._shifts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            self._layouts: dict[tuple[Any, ...], bool | None] = {}  # a cache layout -> keys transposed, or None
            self._refused: set[str] = set()  # layouts refused so far (each said once)
            self._tp = tensor_parallel()  # (rank, size): which kv heads of an entry this worker writes
            self._layerwise = _layerwise_setting(self._kv_transfer_config.kv_connector_extra_config or {})
            self._pipeline: tuple[LayerPipeline, list[Load]] | None = None  # this step's layer-by-layer load
            self._layer_of: dict[str, int | None] = {}  # attention layer name -> its decoder layer's index

    @property
    def seam(self) -> LoadSeam:
        """What the write paths (`direct`, `layered`) read of this worker and may change."""
        return LoadSeam(self)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # loading layer by layer waits inside the forward, which a captured CUDA graph would skip
        return _layerwise_setting(extra_config) is not False

    # -- scheduler side ---------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = TransferPlan.from_params(request.kv_transfer_params)
        if plan is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        end = min(self._available(plan), len(prompt) - 1)  # at least one prompt token is computed, for its logits
        if end <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = (plan, num_computed_tokens, end, prompt[num_computed_tokens:end])
        return end - num_computed_tokens, False

    def _available(self, plan: TransferPlan) -> int:
        """Tokens from the prompt's start whose entries are in the store (up to the first missing one)."""
        covered = 0
        for piece in plan.pieces:
            if piece.key not in self._store:
                break
            covered += piece.length
        return covered

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._pending.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVRAGConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._pending:
                plan, begin, end, ids = self._pending.pop(new.req_id)
                meta.loads.append(Load(plan, list(new.block_ids[0]), begin, end, ids))
                self._loading[new.req_id] = (list(new.block_ids[0]), begin, end)
        # A request vLLM preempted is matched again when it resumes (its KV was freed): it comes back among the
        # cached requests, with every block it now holds, and is loaded again like a new one.
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                plan, begin, end, ids = self._pending.pop(req_id)
                meta.loads.append(Load(plan, list(cached.new_block_ids[i][0]), begin, end, ids))
                self._loading[req_id] = (list(cached.new_block_ids[i][0]), begin, end)
                self._computed_from.pop(req_id, None)  # loaded again: only this load's failure counts
        self._pending.clear()  # matched but not scheduled this step: matched afresh when it is
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """Note where vLLM computes a request from because a block of its load failed (it truncates the request's
        computed tokens to that block's start): vLLM's own count of cached tokens does not say so."""
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        bs = self._block_size
        for req_id, (blocks, begin, end) in self._loading.items():
            failed = next((b for b in range(begin // bs, (end - 1) // bs + 1) if blocks[b] in invalid), None)
            if failed is not None:
                self._computed_from[req_id] = min(self._computed_from.get(req_id, end), failed * bs)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._loading.pop(request.request_id, None)
        computed_from = self._computed_from.pop(request.request_id, None)
        return False, None if computed_from is None else {"kvrag_computed_from": computed_from}

    # -- worker side ------------------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._finish_layers()  # a step's layers are all written before the next step's load starts
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRAGConnectorMetadata)
        layers = _paged_layers(forward_context)
        refused = next((why for _, layer, cache in layers if isinstance(why := layout_of(layer, cache), str)), None)
        if refused is not None:  # nothing is written: vLLM computes every planned token
            if refused not in self._refused:
                self._refused.add(refused)
                warnings.warn(f"kvrag: this worker's cache is {refused}; vLLM computes the planned tokens",
                              KVRAGLoadWarning, stacklevel=2)
            for load in meta.loads:
                self._errors |= {load.block_ids[t // self._block_size] for t in range(load.begin, load.end)}
            return
        on_gpu = bool(layers) and layers[0][2].device.type != "cpu"
        if meta.loads and layers and (self._layerwise or (self._layerwise is None and on_gpu)):
            self._pipeline = layered.start(self, meta.loads, layers), meta.loads
            return
        for load in meta.loads:
            filled = direct.fill(self, load, layers)
            if filled is None:
                filled = self._fill(load, layers)
            # vLLM recomputes from the first failed block on: the pieces before it stay loaded.
            self._errors |= {load.block_ids[t // self._block_size] for t in range(filled, load.end)}

    def _fill(self, load: Load, layers: list[tuple[int, Any, torch.Tensor]]) -> int:
        """Write tokens [begin, end) into the request's blocks, a group of pieces at a time, one write per layer
        each; return where the filling stopped (`end`, or the first token of a piece whose entry is missing or
        damaged).

        Reader threads read the entries, verify their checksums, and rotate the keys into a group's buffer while
        the group before it is written here (file reads, hashing and torch's ops release the GIL)."""
        # Entries are read as stored (a memory tier then holds float16, not float32) and converted into the
        # buffers in the model's dtype, as kvrag's own path reads them; the rotation itself runs in float32.
        groups = _groups(self._spans(load))
        reads = self._read(groups[0], layers, 0) if groups else []
        try:
            for g, group in enumerate(groups):
                mine, reads = reads, self._read(groups[g + 1], layers, (g + 1) % 2) if g + 1 < len(groups) else []
                reasons = [read.result() for read in mine]
                ok = next((n for n, why in enumerate(reasons) if why is not None), len(group))
                self._write_group(load, group[:ok], layers, g % 2)
                if ok < len(group):
                    piece, lo = group[ok][0], group[ok][1]
                    _missed(piece, reasons[ok])
                    return lo
            return load.end
        finally:  # a failed piece: the reads after it are not needed, and none may still write into a buffer
            for read in reads:
                read.cancel()
            wait(reads)

    def _spans(self, load: Load) -> list[Span]:
        """The load's pieces, each with the tokens [lo, hi) of it to load and the prompt's ids there; the store bound
        to read their entries as stored (a memory tier then holds float16, not float32)."""
        self._store.bind(encoder=load.plan.encoder, dtype=None, device="cpu")
        return [
            (p, lo, hi, load.token_ids[lo - load.begin : hi - load.begin])
            for p in load.plan.pieces
            if (lo := max(load.begin, p.position)) < (hi := min(load.end, p.position + p.length))
        ]

    def _read(self, group: list[Span], layers: list[tuple[int, Any, torch.Tensor]], slot: int) -> list[Future]:
        """Start reading a group's pieces into buffer `slot` (each piece its own run of tokens of it)."""
        keys, values = self._buffer(slot, layers, sum(hi - lo for _, lo, hi, _ in group))
        at, reads = 0, []
        for piece, lo, hi, ids in group:
            n = hi - lo
            reads.append(
                self._reader.submit(
                    self._prepared, piece, lo, hi, ids, keys[:, :, at : at + n], values[:, :, at : at + n]
                )
            )
            at += n
        return reads

    def _write_group(
        self, load: Load, group: list[Span], layers: list[tuple[int, Any, torch.Tensor]], slot: int
    ) -> None:
        """Write a group's pieces (read into buffer `slot`) into the request's blocks: one write per layer."""
        if not group:
            return
        keys, values = self._buffers[slot]
        bs, blocks = self._block_size, load.block_ids
        slots = torch.tensor([blocks[t // bs] * bs + t % bs for _, lo, hi, _ in group for t in range(lo, hi)])
        n = len(slots)
        for i, layer, cache in layers:
            # [t, H_kv, D] views: vLLM's write op takes them strided, so nothing is copied to reorder them
            _write(
                layer, cache, keys[i, :, :n].transpose(0, 1), values[i, :, :n].transpose(0, 1), slots.to(cache.device)
            )

    def _buffer(
        self, slot: int, layers: list[tuple[int, Any, torch.Tensor]], tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for a group of `tokens` tokens, [L, H_kv, t, D] each. Two are kept: a group is read into
        one while the other is written. Each grows to the largest group it has held (a piece is never split, so
        a group passes _GROUP_TOKENS by less than its last piece)."""
        _, heads, _, width = layers[0][2].shape if layers else (0, 0, 0, 0)
        shape = (max((i for i, _, _ in layers), default=-1) + 1, heads, max(tokens, _GROUP_TOKENS), width // 2)
        found = self._buffers.get(slot)
        if (
            found is None
            or found[0].shape[:2] != shape[:2]
            or found[0].shape[3] != shape[3]
            or found[0].shape[2] < tokens
        ):
            found = self._buffers[slot] = (torch.empty(shape, dtype=self._dtype), torch.empty(shape, dtype=self._dtype))
        return found[0][:, :, :tokens], found[1][:, :, :tokens]

    @torch.inference_mode()  # as vLLM's forward, which made the buffers: they are inference tensors
    def _prepared(
        self, piece: Piece, lo: int, hi: int, ids: list[int], keys_out: torch.Tensor, values_out: torch.Tensor
    ) -> str | None:
        """Write a piece's keys (rotated to their place) and values for tokens [lo, hi) into the [L, H_kv, t, D]
        views given; None, or for an entry that is missing, damaged, unreadable or of other tokens than the
        prompt's `ids` there, the reason ("" when there is nothing more to say). Runs in a reader thread."""
        found = self._entry(piece, lo, hi, ids)
        if isinstance(found, str):
            return found
        # the layers this worker holds are the first of the entry's; keys post-RoPE at the entry's start
        part = self.seam.worker_part(found, 0, keys_out.shape[0], keys_out.shape[1], keys_out.shape[3])
        if isinstance(part, str):
            return part
        keys, values = part
        if keys.shape[2] != keys_out.shape[2]:  # `_entry` read tokens [lo, hi): a kvrag bug, said as such
            return f" (kvrag read {keys.shape[2]} tokens of the entry for {keys_out.shape[2]}: a bug in kvrag)"
        if piece.position != piece.start:
            assert self._repositioner is not None
            cos, sin = self._angles(piece.position - piece.start)
            self._repositioner.rotate_into(keys_out, keys, cos, sin)  # one shift for all its tokens: [D_rot] angles
        else:
            keys_out.copy_(keys)
        values_out.copy_(values)
        return None

    def _heads(self, stored: int, held: int) -> slice:
        """The kv heads of an entry's `stored` ones this worker writes (all, or its tensor-parallel share)."""
        if stored == held:
            return slice(None)
        try:
            return kv_heads_of(stored, *self._tp)
        except ValueError:
            return slice(0, 0)  # not vLLM's split: the shapes then disagree and the piece is a miss

    def _entry(self, piece: Piece, lo: int, hi: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | str:
        """A piece's stored keys and values for tokens [lo, hi), [L, H_kv, t, D] views of its entry as stored; or for
        an entry that is missing, damaged, unreadable or of other tokens than the prompt's `ids` there, the reason
        ("" when there is nothing more to say). Runs in a reader thread."""
        try:
            kv: ChunkKV | None = self._store.get(piece.key)
        except (KVRAGError, OSError) as err:  # a store that fails is a miss here too, never a dead worker
            return f" ({err})"
        if kv is None or len(kv) != piece.length or kv.start != piece.start:
            return ""
        a, b = lo - piece.position, hi - piece.position
        if kv.token_ids[a:b].tolist() != ids:  # a forged or misplaced entry: never another chunk's KV
            return " (it holds other tokens than the prompt's)"
        return kv.keys[:, :, a:b], kv.values[:, :, a:b]

    def _angles(self, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of one shift, [D_rot] float32 (kept: the same shifts recur from request to request)."""
        found = self._shifts.get(delta)
        if found is None:
            assert self._repositioner is not None
            cos, sin = self._repositioner.angles(torch.tensor([delta]))
            if len(self._shifts) >= 1 << 16:
                self._shifts.clear()
            found = self._shifts[delta] = (cos[0], sin[0])
        return found

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._pipeline is None:
            return  # start_load_kv wrote every layer before the forward started
        if layer_name not in self._layer_of:
            found = _LAYER.search(layer_name)
            self._layer_of[layer_name] = int(found.group(1)) if found else None
        index = self._layer_of[layer_name]
        if index is not None:
            self._pipeline[0].wait(index)

    def _finish_layers(self) -> None:
        if self._pipeline is not None:
            pipeline, loads = self._pipeline
            self._pipeline = None
            layered.finish(self, pipeline, loads)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # kvrag's exact entries are written by kvrag; approximate KV is never saved

    def wait_for_save(self) -> None:
        self._finish_layers()  # after the forward: every layer is written before the next step's reads

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layers()
        errors, self._errors = self._errors, set()
        return errors
