"""What the hardware allows: the machine's matmul rate and read bandwidth, calibrated in the same run, and the
FLOPs and bytes of a forward, so that every measured time reads as a ratio to its floor.

A forward of `new` tokens over `cached` ones must do at least its matrix products (2 FLOPs a weight a token,
the logits' product only for the tokens whose logits are kept) and its attention (QK and PV for every new
token over every key it sees), and must read every weight and every key and value once. Its floor is the
larger of FLOPs over the matmul rate and bytes over the bandwidth: no implementation on this machine can be
faster. This module measures the machine and counts; it runs no model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvrag.cpu import ckernel, hugepages
from kvrag.kvmodel import KVModel


@dataclass(slots=True)
class Machine:
    """What one device does at best, measured here."""

    matmul_flops: float  # FLOP/s of the best of a few square matmuls in the model's dtype
    read_bytes: float  # bytes/s of the best of a few streaming reads of a buffer larger than caches

    @classmethod
    def calibrate(cls, dtype: torch.dtype, device: torch.device | str = "cpu", runs: int = 5) -> Machine:
        """A few seconds of measuring: 2048x2048 matmuls and reads of a 512 MB buffer, best of `runs`. On CPU the
        buffer is on huge pages where the system has them, as kvrag's decode step keeps its weights
        (`kvrag.cpu.hugepages`), and it is read both by torch's sum and by kvrag's streaming read in C where the
        kernels built (`kernels/stream_read.c`, which reads as the decode step's products do, and faster than
        torch's sum here): the floor is the fastest the memory went."""
        device = torch.device(device)
        n = 2048
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        matmul = _best(lambda: a @ b, runs, device)
        count = 512 * (1 << 20) // 4
        if device.type == "cpu":
            x = hugepages.empty((count,), torch.float32).fill_(1)
        else:
            x = torch.ones(count, device=device)
        read = _best(lambda: x.sum(), runs, device)
        if device.type == "cpu" and ckernel.available():
            read = min(read, _best(lambda: ckernel.stream_read(x), runs, device))
        return cls(matmul_flops=2 * n**3 / matmul, read_bytes=x.numel() * x.element_size() / read)

    def best(self, other: Machine) -> Machine:
        """Each rate at the better of the two calibrations: a floor must be the least time the machine allows, and
        a calibration that falls in a slow spell of a shared machine would set it too high."""
        return Machine(max(self.matmul_flops, other.matmul_flops), max(self.read_bytes, other.read_bytes))

    def to_dict(self) -> dict[str, float]:
        return {"matmul_gflop_s": self.matmul_flops / 1e9, "read_gb_s": self.read_bytes / 1e9}


@dataclass(slots=True)
class Cost:
    """The least work of one forward."""

    flops: float  # matrix products and attention
    bytes: float  # weights, and keys and values, each read once

    def floor(self, machine: Machine) -> float:
        """Seconds no implementation on `machine` can beat."""
        return max(self.flops / machine.matmul_flops, self.bytes / machine.read_bytes)


def _best(fn, runs: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    fn()  # first touch and kernel selection outside the timing
    best = float("inf")
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def weight_bytes(kv: KVModel) -> int:
    """Every parameter's bytes once (tied or stacked weights share their storage, counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in kv.model.parameters()}
    return sum(storages.values())


def kv_bytes_per_token(kv: KVModel) -> int:
    """Bytes of one token's keys and values in every layer."""
    prefix = kv.prefix  # [L, H_kv, T, D] keys and values
    return (prefix.keys[:, :, :1].numel() + prefix.values[:, :, :1].numel()) * prefix.keys.element_size()


def forward_cost(kv: KVModel, new: int, cached: int = 0, logits: int = 1) -> Cost:
    """The least FLOPs and bytes of a forward of `new` tokens over `cached` ones, keeping `logits` tokens' logits."""
    model, config = kv.model, kv.model.config
    head = model.get_output_embeddings()
    layer_weights = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    keys_seen = new * cached + new * (new + 1) // 2  # each new token attends to the cache and the new ones before it
    attention = 4 * heads * head_dim * keys_seen * config.num_hidden_layers  # QK and PV, 2 FLOPs a multiply-add
    flops = 2 * layer_weights * new + 2 * head.in_features * head.out_features * logits + attention
    return Cost(flops=float(flops), bytes=float(weight_bytes(kv) + kv_bytes_per_token(kv) * (cached + new)))
