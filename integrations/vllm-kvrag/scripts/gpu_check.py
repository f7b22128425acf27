"""The connector's GPU write path on a GPU machine with torch alone (no vLLM, no kvrag install, no package index):
`layout.scatter` and the keys' rotation on the device, against the same on the CPU, bit for bit, for each of
vLLM's six KVCacheLayouts (their stride orders are copied here from `vllm.v1.kv_cache_layout`) and each cache dtype.

    python integrations/vllm-kvrag/scripts/gpu_check.py [--device cuda]

Prints one line a case and a last line "gpu_check: N of N equal"; exits 1 where any differs. It does not check
vLLM's own `reshape_and_cache_flash` (vLLM is not installed there) nor kvrag's engine on the GPU (that needs
transformers: `tests/test_cuda.py` on a machine with kvrag installed).
"""

import argparse
import importlib.util
import sys
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


def _layout_module():
    """vllm_kvrag/layout.py loaded by its path: it needs torch only (the package's __init__ needs kvrag)."""
    path = Path(__file__).resolve().parents[1] / "vllm_kvrag" / "layout.py"
    spec = importlib.util.spec_from_file_location("kvrag_layout", path)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    layout = _layout_module()
    generator = torch.Generator().manual_seed(0)
    slots = torch.tensor([0, 3, 15, 16, 31, 64, 100, 127])
    keys = torch.randn(len(slots), HEADS, D, generator=generator)
    values = torch.randn(len(slots), HEADS, D, generator=generator)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else device}, torch {torch.__version__}")
    same = total = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for name, order in LAYOUTS.items():
            results = []
            for where in ("cpu", device):
                moved = rotated(keys.to(where), delta=1234)
                written = caches(order, dtype, where)
                for cache in written:
                    layout.scatter(cache, moved, values.to(where), slots.to(where))
                results.append([c.cpu() for c in written])
            equal = all(torch.equal(a, b) for a, b in zip(*results))
            same += equal
            total += 1
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(*results))
            print(f"{name} {str(dtype).removeprefix('torch.')}: {'equal' if equal else f'differs (max {diff:.3g})'}")
    print(f"gpu_check: {same} of {total} equal")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main())
