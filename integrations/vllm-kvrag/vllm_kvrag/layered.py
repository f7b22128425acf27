"""The connector's layer-by-layer load: a step's entries read and checked, then written one layer at a time on a
`LayerPipeline` while vLLM's forward runs, each attention layer waiting for its own layer only.

The keys' rotation runs where the cache is, in float32 (kvrag's Repositioner: its C kernel on CPU, torch's ops on a
GPU), after one copy of the layer's stored keys and values to the device; each layer is one write of every piece of
the load (`paged._write`: vLLM's own op on its CPU backend, `layout.scatter` on a GPU backend's cache).

On by default where the caches are on a GPU; `"layerwise": true` or `false` in the extra config decides it anywhere
(on vLLM's CPU build it is off by default: the forward and the writes would share the same few cores).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvrag.layerwise import LayerPipeline
from vllm_kvrag.paged import KVRAGLoadWarning, _missed, _use_worker_cpus, _write

if TYPE_CHECKING:
    from vllm_kvrag.connector import KVRAGConnector, Load, LoadSeam


@dataclass
class _Staged:
    """One load's pieces, read and checked, to be written a layer at a time: tokens [begin, filled)."""

    entries: list[tuple[torch.Tensor, torch.Tensor]]  # each piece's [L, H_kv, t, D] keys and values: this worker's
    shifts: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor] | None]]  # (a, b) of the load's tokens, angles
    slots: torch.Tensor  # every token's slot, on the cache's device


def start(connector: KVRAGConnector, loads: list[Load], layers: list[tuple[int, Any, torch.Tensor]]) -> LayerPipeline:
    """Start writing `loads` into `layers` a layer at a time; the step's load errors (`LoadSeam.load_errors`) get each load's blocks from
    its first missing or damaged piece on (when the pipeline has prepared, before layer 0 is ready)."""
    layers = sorted(layers, key=lambda x: x[0])
    by_index = {i: (layer, cache) for i, layer, cache in layers}
    device = layers[0][2].device
    pipeline = LayerPipeline([i for i, _, _ in layers], device)
    staged: list[_Staged] = []
    seam = connector.seam

    def prepare() -> None:
        _use_worker_cpus()
        for load in loads:
            found = _read(seam, load, layers, device)
            if found is not None:
                staged.append(found)

    def write(i: int) -> None:
        layer, cache = by_index[i]
        for load in staged:
            _write_layer(seam, load, i, layer, cache)

    pipeline.start(write, prepare)
    return pipeline


def _read(
    seam: LoadSeam, load: Load, layers: list[tuple[int, Any, torch.Tensor]], device: torch.device
) -> _Staged | None:
    """Read and check a load's pieces in the reader threads; stage those up to the first that fails."""
    spans = seam.spans(load)
    found = list(seam.reader.map(lambda s: seam.entry(*s), spans))
    cache = layers[-1][2]
    need, held, width = layers[-1][0] + 1, cache.shape[1], cache.shape[-1] // 2
    entries, shifts, tokens = [], [], []
    filled, at = load.end, 0
    for (piece, lo, hi, _), entry in zip(spans, found):
        if not isinstance(entry, str):
            entry = seam.worker_part(entry, 0, need, held, width)  # its layers up to the last this worker holds
        if isinstance(entry, str):
            _missed(piece, entry)
            filled = lo
            break
        angles = None
        if piece.position != piece.start:
            cos, sin = seam.angles(piece.position - piece.start)
            angles = (cos.to(device), sin.to(device))
        entries.append(entry)
        shifts.append((at, at + hi - lo, angles))
        at += hi - lo
        tokens.append(torch.arange(lo, hi))
    bs = seam.block_size
    seam.load_errors({load.block_ids[t // bs] for t in range(filled, load.end)})
    if not entries:
        return None
    blocks = torch.tensor(load.block_ids, dtype=torch.int64)
    where = torch.cat(tokens)
    slots = (blocks[where // bs] * bs + where % bs).to(device)
    return _Staged(entries, shifts, slots)


def _write_layer(seam: LoadSeam, load: _Staged, i: int, layer: Any, cache: torch.Tensor) -> None:
    """Write layer `i` of a staged load: one copy of its stored keys and values to the cache's device, the keys
    rotated there in float32, one write into the blocks."""
    keys = torch.cat([k[i] for k, _ in load.entries], dim=1).to(cache.device)  # [H_kv, T, D], as stored
    values = torch.cat([v[i] for _, v in load.entries], dim=1).to(cache.device)
    out = torch.empty(keys.shape, dtype=seam.dtype, device=cache.device)
    for a, b, angles in load.shifts:
        if angles is None:
            out[:, a:b].copy_(keys[:, a:b])
        else:
            assert seam.repositioner is not None
            seam.repositioner.rotate_into(out[None, :, a:b], keys[None, :, a:b], *angles)
    _write(layer, cache, out.transpose(0, 1), values.to(seam.dtype).transpose(0, 1), load.slots)


def finish(connector: KVRAGConnector, pipeline: LayerPipeline, loads: list[Load]) -> None:
    """Wait for a step's layer-by-layer load; where it failed, every block it was to fill is a load error."""
    error = pipeline.join()
    if error is None:
        return
    warnings.warn(
        f"kvrag: loading stored KV a layer at a time failed ({type(error).__name__}: {error}); vLLM computes the "
        "planned tokens",
        KVRAGLoadWarning,
        stacklevel=2,
    )
    seam, bs = connector.seam, connector.seam.block_size
    for load in loads:
        seam.load_errors({load.block_ids[t // bs] for t in range(load.begin, load.end)})
