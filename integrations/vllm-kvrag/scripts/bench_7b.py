"""Time to first token at a 7B model's shape with random weights, torch alone (for a GPU machine with no package
index): full prefill of the whole prompt against `target_recompute`'s work, the target chunk and the question
computed over the other chunks' KV read from host memory as a store holds it (float16), keys rotated to their place.

    python integrations/vllm-kvrag/scripts/bench_7b.py [--device cuda] [--context 8192] [--shape 7b|tiny]

The model is a Llama-style decoder (RMSNorm, rotate-half RoPE, grouped-query attention, SwiGLU MLP) of Llama 3 8B's
shape less its large vocabulary (32 layers, hidden 4096, 32 heads, 8 kv heads, MLP 14336, vocabulary 32000: 7.0 B
parameters, bfloat16). Weights are random: the timings are the shape's, no answer is read. Three ways are timed for
`target_recompute`: the KV already on the device (the floor), loaded whole then computed, and loaded layer by layer
beside the forward with the connector's `LayerPipeline` (each layer waits for its own KV only). Prints one line each
and the ratios to full prefill; the median of `--runs`.
"""

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {
    "7b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, mlp=14336, vocab=32000),
    "tiny": dict(layers=4, hidden=256, heads=4, kv_heads=2, mlp=512, vocab=1000),  # that it runs, on CPU
}


def _layerwise():
    path = Path(__file__).resolve().parents[1] / "vllm_kvrag" / "layerwise.py"
    spec = importlib.util.spec_from_file_location("kvrag_layerwise", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Model:
    """Random weights of the shape, and a forward over a [T] of new tokens after `past` cached ones per layer."""

    def __init__(self, shape, device, dtype):
        self.__dict__.update(shape)
        self.device, self.dtype, self.head_dim = device, dtype, shape["hidden"] // shape["heads"]
        g = torch.Generator(device=device).manual_seed(0)

        def w(*size):
            return (torch.randn(*size, generator=g, device=device, dtype=dtype) / size[-1] ** 0.5).contiguous()

        kv = self.kv_heads * self.head_dim
        self.embed = w(self.vocab, self.hidden)
        self.weights = [
            (w(self.hidden + 2 * kv, self.hidden), w(self.hidden, self.hidden), w(2 * self.mlp, self.hidden),
             w(self.hidden, self.mlp))
            for _ in range(self.layers)
        ]  # fmt: skip
        inv = 1.0 / (1e6 ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim))
        self.inv = torch.cat([inv, inv])

    def rope(self, x, positions):
        angle = (positions[:, None].float() * self.inv)[:, None]  # [T, 1, D]
        half = self.head_dim // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return (x.float() * angle.cos() + turned.float() * angle.sin()).to(x.dtype)

    def forward(self, ids, past, cache, wait=lambda i: None):
        """Logits of the last token. `cache[i]` holds layer i's [2, H_kv, past + T, D] keys and values: its first
        `past` tokens are given (and waited for with `wait(i)`), the new tokens' are written here."""
        t = len(ids)
        positions = torch.arange(past, past + t, device=self.device)
        x = self.embed[ids]
        for i, (qkv_w, o_w, up_w, down_w) in enumerate(self.weights):
            h = F.rms_norm(x, (self.hidden,))
            width = self.kv_heads * self.head_dim
            q, k, v = (h @ qkv_w.T).split([self.hidden, width, width], -1)
            q = self.rope(q.view(t, self.heads, self.head_dim), positions).transpose(0, 1)
            k = self.rope(k.view(t, self.kv_heads, self.head_dim), positions).transpose(0, 1)
            wait(i)
            cache[i][0, :, past:] = k
            cache[i][1, :, past:] = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
            keys, values = cache[i][0], cache[i][1]
            if past == 0:  # a whole prompt: the causal (flash) kernel
                a = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, enable_gqa=True)
            else:  # new tokens after cached ones: each sees every cached token and the new ones up to itself
                mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)
                a = F.scaled_dot_product_attention(
                    q[None], keys[None], values[None], attn_mask=mask[None, None], enable_gqa=True
                )
            x = x + a[0].transpose(0, 1).reshape(t, self.hidden) @ o_w.T
            gate, up = (F.rms_norm(x, (self.hidden,)) @ up_w.T).chunk(2, -1)
            x = x + (F.silu(gate) * up) @ down_w.T
        return F.rms_norm(x[-1], (self.hidden,)) @ self.embed.T


def rotate(keys, delta, inv):
    """Rotate-half RoPE by one shift in float32 (kvrag's Repositioner's arithmetic), back to the keys' dtype."""
    angle = inv * delta
    cos, sin = angle.cos(), angle.sin()
    k = keys.float()
    half = k.shape[-1] // 2
    out = k * cos
    out[..., :half].addcmul_(k[..., half:], sin[:half], value=-1)
    out[..., half:].addcmul_(k[..., :half], sin[half:])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--context", type=int, default=8192, help="tokens of retrieved chunks")
    parser.add_argument("--target", type=int, default=512, help="the target chunk's tokens, computed again")
    parser.add_argument("--question", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = True
    model = Model(SHAPES[args.shape], device, dtype)
    layerwise = _layerwise()
    past = args.context - args.target  # the reused chunks, before the target (moved next to the question)
    new = args.target + args.question
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.vocab, (args.context + args.question,), generator=g).to(device)
    kv_shape = (2, model.kv_heads, past, model.head_dim)
    stored = [torch.randn(kv_shape, generator=g).half() for _ in range(model.layers)]  # host memory, as stored
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    params = sum(w.numel() for layer in model.weights for w in layer) + model.embed.numel()
    print(f"device: {name}, torch {torch.__version__}; {args.shape} shape, {params / 1e6:,.0f} M parameters, bfloat16; "
          f"{args.context} context tokens + {args.question} question tokens, target {args.target}")  # fmt: skip

    def fresh(tokens):
        return [torch.empty(2, model.kv_heads, tokens, model.head_dim, device=device, dtype=dtype) for _ in stored]

    def load(cache, i):
        kv = stored[i].to(device)
        cache[i][0, :, :past] = rotate(kv[0], 977, model.inv).to(dtype)
        cache[i][1, :, :past] = kv[1]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def full():
        model.forward(ids, 0, fresh(len(ids)))

    loaded = fresh(past + new)
    for i in range(model.layers):
        load(loaded, i)

    def floor():
        model.forward(ids[-new:], past, loaded)

    def whole():
        cache = fresh(past + new)
        for i in range(model.layers):
            load(cache, i)
        model.forward(ids[-new:], past, cache)

    def layered():
        cache = fresh(past + new)
        pipeline = layerwise.LayerPipeline(list(range(model.layers)), device)
        pipeline.start(lambda i: load(cache, i))
        model.forward(ids[-new:], past, cache, wait=pipeline.wait)
        if pipeline.join() is not None:
            raise pipeline.error

    times = {}
    ways = [("full prefill", full), ("target_recompute, KV on the device (floor)", floor),
            ("target_recompute, KV loaded whole, then computed", whole),
            ("target_recompute, KV loaded layer by layer", layered)]  # fmt: skip
    with torch.inference_mode():
        for _, run in ways:  # warm-up: kernels chosen, memory pooled
            run()
            sync()
        for _ in range(args.runs):
            for label, run in ways:  # interleaved: a slow moment of the machine is shared by all
                started = time.perf_counter()
                run()
                sync()
                times.setdefault(label, []).append(time.perf_counter() - started)
    full_s = statistics.median(times["full prefill"])
    for label, _ in ways:
        s = statistics.median(times[label])
        print(f"{label}: {s * 1e3:.1f} ms" + ("" if label == "full prefill" else f" ({full_s / s:.1f}x sooner)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
