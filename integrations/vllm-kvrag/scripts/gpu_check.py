"""The connector's GPU write path on a GPU machine with torch alone (no vLLM, no kvrag install, no package index).

1. `layout.scatter` on the device against the same on the CPU, bit for bit, for each of vLLM's six KVCacheLayouts
   (their stride orders are copied here from `vllm.v1.kv_cache_layout`) and each cache dtype;
2. the keys' rotation (kvrag's Repositioner's float32 arithmetic) on the device against the CPU: bit for bit, or
   how many float32 units in the last place apart (a fused multiply-add rounds once where the CPU rounds twice);
3. `layerwise.LayerPipeline`: a step's 32 layers written on a side thread and stream while a stand-in forward runs
   each layer after `wait(layer)`; every layer the forward read equal to the same writes done before it, and the
   time of loading then running against both overlapped.

    python integrations/vllm-kvrag/scripts/gpu_check.py [--device cuda]

Prints one line a case and a last line "gpu_check: N of N equal"; exits 1 where any differs (a rotation within one
unit in the last place counts as equal, and says so). It does not check vLLM's own `reshape_and_cache_flash` (vLLM is
not installed there) nor kvrag's engine on the GPU (that needs transformers: `tests/behaviour/test_cuda.py`, which
`gpu_check.sh` runs where it can).
"""

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import torch

# vllm.v1.kv_cache_layout.KVCacheLayout: logical [L, B, H, N, C] -> physical order
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, D = 2, 8, 16, 4, 128


def _module(name):
    """vllm_kvrag/NAME.py loaded by its path: it needs torch only (the package's __init__ needs kvrag)."""
    path = Path(__file__).resolve().parents[1] / "vllm_kvrag" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kvrag_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def caches(order, dtype, device):
    """Each layer's logical [B, H, N, 2 D] view of one buffer laid out in `order`, as vLLM strides it."""
    shape = (LAYERS, BLOCKS, HEADS, BLOCK_SIZE, 2 * D)
    strides, step = [0] * 5, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=dtype, device=device)
    whole = torch.as_strided(raw, shape, strides)
    return [whole[i] for i in range(LAYERS)]


def rotated(keys, delta, base=1e6):
    """Rotate-half RoPE of [T, H, D] keys by one shift, in float32 (kvrag's Repositioner's arithmetic)."""
    inv = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32, device=keys.device) / D))
    angle = torch.cat([inv, inv]) * delta
    cos, sin = angle.cos(), angle.sin()
    k = keys.float()
    half = D // 2
    out = k * cos
    out[..., :half].addcmul_(k[..., half:], sin[:half], value=-1)
    out[..., half:].addcmul_(k[..., :half], sin[half:])
    return out


def check_scatter(layout, device, keys, values, slots):
    """Each layout and dtype: the same rotated keys written on the CPU and on the device, bit for bit."""
    same = total = 0
    moved = rotated(keys, delta=1234)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for name, order in LAYOUTS.items():
            results = []
            for where in ("cpu", device):
                written = caches(order, dtype, where)
                for cache in written:
                    layout.scatter(cache, moved.to(where), values.to(where), slots.to(where))
                results.append([c.cpu() for c in written])
            equal = all(torch.equal(a, b) for a, b in zip(*results))
            same += equal
            total += 1
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*results))
            verdict = "equal" if equal else f"differs ({diff:.3g})"
            print(f"scatter {name} {str(dtype).removeprefix('torch.')}: {verdict}")
    return same, total


def check_rotation(device, keys):
    """The rotation on the device against the CPU, for shifts near and far: float32 units in the last place apart."""
    same = total = 0
    for delta in (1, 1234, 100_000):
        for dtype in (torch.float32, torch.bfloat16):
            here = rotated(keys.to(dtype), delta)
            there = rotated(keys.to(dtype).to(device), delta).cpu()
            ulps = int((here.view(torch.int32).long() - there.view(torch.int32).long()).abs().max())
            verdict = "equal" if ulps == 0 else f"within {ulps} ulp" if ulps <= 1 else f"differs ({ulps} ulp)"
            print(f"rotation by {delta} of {str(dtype).removeprefix('torch.')} keys: {verdict}")
            same += ulps <= 1
            total += 1
    return same, total


def check_pipeline(layerwise, layout, device, layers=32, tokens=4096, heads=8, width=4096):
    """A step's layers written beside a stand-in forward: what each layer read after its wait is what the same writes
    leave when done first; the wall time of both ways. The stand-in's products run in bfloat16 on a GPU and in float32
    on a CPU (where bfloat16 products may be emulated, hundreds of times slower)."""
    generator = torch.Generator().manual_seed(1)
    stored_k = torch.randn(layers, tokens, heads, D, generator=generator).half()  # as a store holds them
    stored_v = torch.randn(layers, tokens, heads, D, generator=generator).half()
    blocks = tokens // BLOCK_SIZE + 4
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=generator)[:tokens]
    work = torch.float32 if device == "cpu" else torch.bfloat16
    weight = torch.randn(width, width, device=device, dtype=work) / width**0.5
    hidden = torch.randn(tokens // 8, width, device=device, dtype=work)

    def fresh():
        shape = (blocks, heads, BLOCK_SIZE, 2 * D)
        return [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]

    def write(cache_list, i):
        k = rotated(stored_k[i].to(device), delta=777)
        layout.scatter(cache_list[i], k, stored_v[i].to(device), slots.to(device))

    def forward(cache_list, wait):
        seen, h = [], hidden
        for i in range(layers):
            wait(i)
            seen.append(cache_list[i][slots.to(device) // BLOCK_SIZE, :, slots.to(device) % BLOCK_SIZE].clone())
            for _ in range(4):  # a layer's worth of work
                h = torch.tanh(h @ weight)
        return seen

    def sync():
        if device != "cpu":
            torch.cuda.synchronize()

    reference = fresh()
    for i in range(layers):
        write(reference, i)
    expected = forward(reference, lambda i: None)  # also warms the kernels up
    sync()
    started = time.perf_counter()
    serial = fresh()
    for i in range(layers):
        write(serial, i)
    forward(serial, lambda i: None)
    sync()
    serial_s = time.perf_counter() - started
    started = time.perf_counter()
    piped = fresh()
    pipeline = layerwise.LayerPipeline(list(range(layers)), torch.device(device))
    pipeline.start(lambda i: write(piped, i))
    seen = forward(piped, pipeline.wait)
    error = pipeline.join()
    sync()
    piped_s = time.perf_counter() - started
    equal = error is None and all(torch.equal(a, b) for a, b in zip(seen, expected))
    equal = equal and all(torch.equal(a, b) for a, b in zip(piped, reference))
    print(
        f"layer pipeline, {layers} layers of {tokens} tokens: {'equal' if equal else f'differs ({error!r})'}; "
        f"load then forward {serial_s * 1e3:.1f} ms, overlapped {piped_s * 1e3:.1f} ms"
    )
    return int(equal), 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    layout, layerwise = _module("layout"), _module("layerwise")
    generator = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 3, 15, 16, 31, 64, 100, 127])
    keys = torch.randn(len(slots), HEADS, D, generator=generator)
    values = torch.randn(len(slots), HEADS, D, generator=generator)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else device}, torch {torch.__version__}")
    same = total = 0
    small = {"tokens": 512, "width": 512} if device == "cpu" else {}  # on a CPU: that it runs
    for found in (
        check_scatter(layout, device, keys, values, slots),
        check_rotation(device, keys),
        check_pipeline(layerwise, layout, device, **small),
    ):
        same, total = same + found[0], total + found[1]
    print(f"gpu_check: {same} of {total} equal")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
