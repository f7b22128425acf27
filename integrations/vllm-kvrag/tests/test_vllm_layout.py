"""kvrag's write into a GPU backend's paged cache, checked on CPU: for every KVCacheLayout of the installed vLLM, in
the caches vLLM's own `create_kv_cache_views` makes, what `layout.scatter` writes is what the FlashAttention,
FlashInfer and Triton backends read back through their own views of the cache, bit for bit in the cache dtype; the
refused layouts are named; each tensor-parallel worker writes vLLM's own share of the kv heads."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is installed in .venv-vllm only (make test runs these tests there)")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, compute_layout_strides  # noqa: E402
from vllm.v1.kv_cache_interface import create_kv_cache_views  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from vllm_kvrag.layout import PagedLayout, kv_heads_of, layout_of, scatter  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, D = 3, 6, 16, 2, 64


def _vllm_caches(layout: KVCacheLayout, dtype: torch.dtype) -> list[torch.Tensor]:
    """Every layer's [blocks, heads, block tokens, 2 D] cache as vLLM's GPU model runner allocates it for `layout`."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=D, dtype=dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    tensor = KVCacheTensor(size=size, layers=[f"layers.{i}.attn" for i in range(LAYERS)], layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, BLOCKS, layout, tensor)


def _read_back(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] keys and values at `slots`, read as the GPU backends read their cache: FlashAttention's (and
    Triton's) `kv_cache.transpose(1, 2).split(head_size, dim=-1)`, [blocks, block tokens, heads, D] each."""
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
    blocks, tokens = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    return key_cache[blocks, tokens], value_cache[blocks, tokens]


class _GPULayer:  # an attention layer of a GPU backend, as the connector sees it: no `isa`
    class impl:  # noqa: N801
        kv_cache_dtype = "auto"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
def test_every_layout_reads_back_what_kvrag_wrote_bit_for_bit(layout, dtype):
    caches = _vllm_caches(layout, dtype)
    assert [c.shape for c in caches] == [(BLOCKS, HEADS, BLOCK_SIZE, 2 * D)] * LAYERS
    generator = torch.Generator().manual_seed(1)
    slots = torch.tensor([0, 5, 15, 16, 17, 40, 63, 95])  # across blocks' ends, out of order between blocks
    written = []
    for cache in caches:
        found = layout_of(_GPULayer(), cache)
        assert found == PagedLayout("split", BLOCK_SIZE, HEADS, D, dtype)
        keys = torch.randn(len(slots), HEADS, D, generator=generator)  # float32: converted on the way, as vLLM's op
        values = torch.randn(len(slots), HEADS, D, generator=generator)
        scatter(cache, keys, values, slots)
        written.append((keys.to(dtype), values.to(dtype)))
    for cache, (keys, values) in zip(caches, written):  # no layer overwrote another's pages
        got_keys, got_values = _read_back(cache, slots)
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
        others = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        others[slots] = False
        rest = cache.transpose(1, 2).reshape(BLOCKS * BLOCK_SIZE, HEADS, 2 * D)[others]
        assert not rest.any()  # nothing but the slots was written


def test_fp8_and_odd_caches_are_refused_by_name():
    class FP8Layer:
        class impl:  # noqa: N801
            kv_cache_dtype = "fp8_e4m3"

    cache = torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * D, dtype=torch.bfloat16)
    assert "fp8_e4m3" in layout_of(FP8Layer(), cache)
    assert "shape (6, 2, 16, 127)" in layout_of(_GPULayer(), torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 127))
    assert "torch.int8" in layout_of(_GPULayer(), torch.zeros(BLOCKS, HEADS, BLOCK_SIZE, 2 * D, dtype=torch.int8))


@pytest.mark.parametrize("total, size", [(2, 1), (2, 2), (4, 2), (2, 4), (1, 4), (8, 8)])
def test_each_worker_writes_vllms_own_share_of_the_kv_heads(total, size):
    """The shares are those of vLLM's QKVParallelLinear (its k/v weight loader's shard of each rank), and the
    workers' writes put together are one worker's cache (replicated heads written by each of their workers)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear  # noqa: F401 - the rule checked is this class's

    heads_of = [kv_heads_of(total, rank, size) for rank in range(size)]
    each = max(1, total // size)
    replicas = size // total if size >= total else 1
    for rank, heads in enumerate(heads_of):  # vLLM: shard_rank = tp_rank // num_kv_head_replicas, shard_size heads
        start = (rank // replicas) * each
        assert heads == slice(start, start + each)
    covered = sorted({h for s in heads_of for h in range(total)[s]})
    assert covered == list(range(total))
    slots = torch.tensor([1, 18, 33])
    keys = torch.randn(len(slots), total, D)
    one = torch.zeros(BLOCKS, total, BLOCK_SIZE, 2 * D)
    scatter(one, keys, keys + 1, slots)
    for heads in heads_of:
        mine = torch.zeros(BLOCKS, each, BLOCK_SIZE, 2 * D)
        scatter(mine, keys[:, heads], keys[:, heads] + 1, slots)
        assert torch.equal(mine, one[:, heads])
    with pytest.raises(ValueError, match="evenly"):
        kv_heads_of(3, 0, 2)


def test_the_gpu_check_script_runs_with_torch_alone_and_finds_the_cpu_equal_to_itself():
    """scripts/gpu_check.py is what a GPU machine without vLLM runs; here on CPU against CPU (it must at least run)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "gpu_check: 25 of 25 equal"
