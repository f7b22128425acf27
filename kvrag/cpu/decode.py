"""One decode step written for speed, on the model's own weights: what `generate.decode` runs for llama-family
models instead of a whole transformers forward. Beside it: the C step (`cstep`), the weights' layout (`weights`),
the torch step's pieces and its compiled form (`steps`), the CUDA graphs (`graphs`) and the cache's room (`room`).

On CPU a token's step is mostly vector-matrix products, and torch runs each of them on one core at about a
third of the memory bandwidth (docs/performance.md). Here each product is split by output rows into one part
a thread, run as one batched matmul over views of the same weights: the same dot products (bitwise), on every
core. q, k and v are one such product, and so are gate and up: their weights are stacked once and the
model's own modules view the stack (no second copy). The rest of a step is a short loop over layers: the
rotary embedding looked up from a table that the model's own rotary module computes (so scaled RoPE is the
model's), the new key and value written into the cache's preallocated room, attention over the filled slots,
and no mask, position or cache bookkeeping. On CPU that attention is `kvrag.cpu.ckernel`'s C kernel where it built
(every key and value read once, in float32 vectors, blocks of slots across the threads), else torch's. Its
tokens are those of the transformers forward (tested in float32 on every architecture it takes). It never
builds a prompt or a cache: the prefill's cache is read and extended in place.

Taken: llama, mistral, qwen2, qwen3 and phi3 (rotate-half RoPE over the whole head, RMSNorm, gated SiLU MLP, no
sliding window; phi3's stacked q/k/v and gate/up modules are read as they are).
Anything else decodes through transformers (`supports` says why).

In C (the default where it builds): `kvrag.cpu.cstep.DecodeStep` runs the same step, every layer and the head,
in one call a token (`kernels/decode_step.c`), over the same weights and cache, float32 or bfloat16; `steps`
runs up to eight consecutive tokens in one pass over the weights, each one's logits bit for bit its own step's
(what greedy decoding's prompt-lookup drafts are checked with, where `batched` says so: `kvrag.run.generate.decode`).
Its products read each weight row in order, so the cores stream the weights near the memory bandwidth (twice the
torch step's rate in bfloat16 here: docs/performance.md, "Decoding"), and nothing runs in Python between the
layers. Its logits equal the torch step's to float32 rounding in float32; in bfloat16 it rounds where the torch
step rounds, so they differ by the order of sums (about one bfloat16 step of a logit). `native_decoding(model,
False)` puts a model back on the torch step.

On CUDA (the default there): `GraphSteps` captures the whole step, every layer and the head, as one CUDA graph
per set of cache buffers (`static_step`: its inputs are device tensors and its attention reads every slot of the
buffers, the free ones masked, so no shape depends on the token) and replays it, one launch a token in place of
a few hundred small kernels from Python (docs/performance.md, "On a GPU"). `native_decoding(model, False)` puts
it back on the torch step.

Compiled (`compile_decoding(model)`, `KVModel(compile_decode=True)`, `--compile-decode`): each layer's step is
one function that torch.compile (inductor) turns into a few fused C++ kernels, compiled once a model and
replayed for every layer and token; the number of cached tokens is a dynamic dimension, so a longer cache
compiles nothing. Its products are written as reductions, which inductor generates as vectorized dot products
over the weight rows on every core (closer to the memory bandwidth than a vector-matrix product through
MKL). Its attention is the C kernel's where it built (`kvrag::decode_attention`, an op the graph calls as it
is); else the graph's own, split into blocks of BLOCK cache slots (flash-decoding), so every cached key and
value is read once and the cores share the blocks; the cache keeps the room for whole blocks (`decode_room`).
It costs seconds of compilation on a model's first decoded token (inductor keeps the result on disk for later
processes), so it pays off in a process that answers many questions. Its logits equal the eager step's to
float32 rounding (the sums run in another order); where the compiler is missing or fails, decoding warns once
and stays on the eager step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvrag.compat import rope_parameters
from kvrag.cpu import ckernel, cstep, state
from kvrag.cpu.graphs import GraphSteps
from kvrag.cpu.linear import PrefillLinear
from kvrag.cpu.room import Room  # noqa: F401 - where callers find it (`kvrag.cpu.Room`)
from kvrag.cpu.steps import BLOCK, split_heads, kernel_takes, rms_norm, compiled, rope
from kvrag.cpu.weights import Product, arranged, layer_projections, stacked_bias

TAKEN = ("llama", "mistral", "qwen2", "qwen3", "phi3")
PLAIN_LINEARS = (torch.nn.Linear, PrefillLinear)  # the same product (`kvrag.cpu.linear`)


@dataclass(slots=True)
class FastLayer:
    """One decoder layer's weights as a single-token step reads them."""

    norm_in: torch.Tensor  # [D] input RMSNorm weight
    qkv: Product  # q, k and v stacked: [(Hq + 2 Hkv) d, D]
    q_norm: torch.Tensor | None  # [d] per-head RMSNorm of queries (qwen3), else None
    k_norm: torch.Tensor | None  # [d] per-head RMSNorm of keys (qwen3), else None
    o: Product  # [D, Hq d]
    norm_post: torch.Tensor  # [D] post-attention RMSNorm weight
    gate_up: Product  # gate and up stacked: [2F, D]
    down: Product  # [D, F]


def _off_the_file(model: torch.nn.Module, ours: list[torch.Tensor]) -> None:
    """Copy the model's CPU tensors that the decoder has not already copied (`ours`: the products' weights and biases,
    `arranged`) into the process's own memory: the norms' weights, chiefly.

    transformers maps the safetensors file and the loaded tensors view it: while any one of them lives the whole
    mapping stays, every page of it read once at load and counted in the process's memory, beside the copy the
    decoder made. On the 1.5B that was 7.4 GB resident after load for 3.1 GB of weights. Called before anything
    takes a pointer to them (the C step): the modules see the new tensors, the mapping goes with its last view.
    """
    kept = {t.untyped_storage().data_ptr() for t in ours}
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):  # a tied weight once: its modules share the tensor
            storage = tensor.untyped_storage()  # a file's mapping cannot be resized; memory torch allocated can
            if tensor.device.type == "cpu" and not storage.resizable() and storage.data_ptr() not in kept:
                tensor.data = tensor.data.clone()


def supports(model: torch.nn.Module) -> str | None:
    """None when `FastDecoder` takes this model; else why it decodes through transformers."""
    config = model.config
    if config.model_type not in TAKEN:
        return f"model type {config.model_type!r} (fast decoding takes {', '.join(TAKEN)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "a sliding attention window"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        return "no model.layers / lm_head"
    if rope_parameters(config).get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, o, gate_up, down = layer_projections(layer)
        linears = [*qkv, o, *gate_up, down]
        # plain float linears only: a quantized, adapted (LoRA), offloaded or hooked module computes something else
        if any(type(m) not in PLAIN_LINEARS or m._forward_hooks or m._forward_pre_hooks for m in linears):
            return "projections that are not plain nn.Linear (quantized, adapted or hooked)"
        if any(not m.weight.is_floating_point() or m.weight.is_meta for m in linears):
            return "weights that are not floating-point tensors in memory"
        activation = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
        if hasattr(layer, "_hf_hook") or type(activation).__name__ not in ("SiLU", "SiLUActivation"):
            return "a hooked layer or an activation other than SiLU"
        if any(getattr(m, "bias", None) is not None for m in (o, *gate_up, down)):
            return "biases outside the q/k/v projections"
        if getattr(attn, "sliding_window", None):
            return "a sliding attention window"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit soft-capping"
    return None


class FastDecoder:
    """One model's weights as a step reads them, and its single-token step over a prefill's cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = supports(model)
        if reason is not None:
            raise ValueError(f"fast decoding does not take this model: {reason}")
        config, inner = model.config, model.model
        # the model's parts, never the model itself: the model's state holds this decoder, and must not keep it alive
        self.rotary_emb = inner.rotary_emb
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = inner.layers[0].self_attn.scaling
        self.norm = inner.norm.weight  # [D]
        self.threads = max(1, torch.get_num_threads())
        self.layers = [self._layer(layer, self.threads) for layer in inner.layers]
        (head,) = arranged([(model.lm_head,)])  # the embedding too, where the model ties them
        products = [p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        _off_the_file(model, ours=[head, *(t for p in products for t in (p.weight, p.bias) if t is not None)])
        self.embed = inner.embed_tokens.weight  # [V, D]
        self.lm_head = Product(head, None, self.threads)  # [V, D]
        self.native = cstep.DecodeStep.of(self)  # the whole step in C, where the kernels built and take it
        self.graphs = GraphSteps(self) if self.embed.is_cuda else None  # on CUDA, the whole step as one graph
        self.use_native = True  # `native_decoding(model, False)` turns both off (the torch step decodes)
        self.compiled: tuple[Any, Any] | None = None  # (layer step, head) once `compile` is called
        self._compiled_ran = False  # whether a compiled step has run: a failure after that is no missing compiler
        self.prefill_classes: tuple[type, ...] | None = None  # the modules' classes the C prefill last took

    @staticmethod
    def _layer(layer: torch.nn.Module, parts: int) -> FastLayer:
        attn = layer.self_attn
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        projections, o_proj, gate_up_projs, down_proj = layer_projections(layer)
        qkv, o, gate_up, down = arranged([projections, (o_proj,), gate_up_projs, (down_proj,)])
        return FastLayer(
            norm_in=layer.input_layernorm.weight,
            qkv=Product(qkv, stacked_bias(*projections), parts),
            q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None,
            o=Product(o, None, parts),
            norm_post=layer.post_attention_layernorm.weight,
            gate_up=Product(gate_up, None, parts),
            down=Product(down, None, parts),
        )

    def current(self, model: torch.nn.Module) -> bool:
        """Whether `model` still computes with the weights this decoder reads (none replaced, cast or moved)."""
        inner = model.model
        head = model.lm_head.weight
        if inner.embed_tokens.weight is not self.embed or head.data_ptr() != self.lm_head.weight.data_ptr():
            return False
        for layer, fast in zip(inner.layers, self.layers):
            qkv, o, gate_up, down = layer_projections(layer)
            if (
                qkv[0].weight.data_ptr() != fast.qkv.weight.data_ptr()
                or gate_up[0].weight.data_ptr() != fast.gate_up.weight.data_ptr()
                or o.weight.data_ptr() != fast.o.weight.data_ptr()
                or down.weight.data_ptr() != fast.down.weight.data_ptr()
                or layer.input_layernorm.weight is not fast.norm_in
            ):
                return False
        return True

    def _resplit(self, threads: int) -> None:
        self.threads = threads
        for product in [
            self.lm_head,
            *(p for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)),
        ]:
            product.resplit(threads)

    def rotary(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [count, d] for positions start.. from the model's rotary module (its scaling included)."""
        positions = torch.arange(start, start + count, device=self.embed.device)[None]
        probe = self.embed[:1][None]  # the module reads only its dtype and device
        cos, sin = self.rotary_emb(probe, positions)
        return cos[0], sin[0]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    _rope = staticmethod(rope)

    def compile(self) -> None:
        """Run steps through torch.compile'd layer and head functions from the next step on (compiled then)."""
        if self.compiled is None:
            self.compiled = compiled()

    @torch.inference_mode()
    def step(
        self,
        token: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        filled: int,
    ) -> torch.Tensor:
        """Logits [V] for `token` at the position whose rotary rows are cos, sin [d]; its key and value go to slot
        `filled` of every layer's keys/values buffers [H_kv, capacity, d], whose first `filled` slots attend."""
        if self.native is not None and self.use_native and self.native.takes(cos, keys, values):
            return self.native(token, cos, sin, keys, values, filled)
        if self.graphs is not None and self.use_native:
            return self.graphs(token, cos, sin, keys, values, filled)
        # compiled where the buffers hold whole blocks up to this slot (`decode_room` keeps them), else eager
        if self.compiled is not None and keys[0].shape[1] >= -(-(filled + 1) // BLOCK) * BLOCK:
            try:
                return self._compiled_step(token, cos, sin, keys, values, filled)
            except Exception as error:  # noqa: BLE001 - no compiler, or one that fails: the eager step is exact
                if self._compiled_ran:
                    raise  # it compiled and ran before: this is no missing compiler
                self.compiled = None
                warnings.warn(
                    f"compiled decoding is off, the eager step decodes: torch.compile failed "
                    f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if torch.get_num_threads() != self.threads:  # one part a thread, as many as torch runs now
            self._resplit(max(1, torch.get_num_threads()))
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        kernel = kernel_takes(keys, values, hq // hkv)
        scratch = torch.empty(ckernel.scratch_size(hkv, hq // hkv, d, filled + 1)) if kernel else None
        x = self.embed[token]  # [D]
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.norm_in)
            q, k, v = split_heads(layer.qkv(h), hq, hkv, d, layer.q_norm, layer.k_norm, self.eps, cos, sin)
            keys[i][:, filled] = k
            values[i][:, filled] = v
            if kernel:
                out = ckernel.decode_attention(q.float(), keys[i], values[i], filled + 1, scratch, self.scale)
                out = out.to(x.dtype)
            else:
                # the heads that share a kv head form that head's query rows: attention needs no repeated keys and,
                # for one new token seeing every cached one, no mask; the scale goes on q alone (torch's attention
                # also scales every cached key, a pass over the whole cache)
                scores = (q.view(hkv, hq // hkv, d) * self.scale) @ keys[i][:, : filled + 1].transpose(1, 2)
                weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # [H_kv, G, T]
                out = weights @ values[i][:, : filled + 1]  # [H_kv, G, d]
            x = x + layer.o(out.reshape(hq * d))
            h = self._rms(x, layer.norm_post)
            gate, up = layer.gate_up(h).chunk(2)
            x = x + layer.down(F.silu(gate) * up)
        return self.lm_head(self._rms(x, self.norm)).float()

    def static_step(
        self,
        token: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        slot: torch.Tensor,
    ) -> torch.Tensor:
        """`step` with its inputs as tensors on the model's device (token and slot [1]) and every shape fixed by
        the buffers, not by the slot: what a CUDA graph captures once and replays (`GraphSteps`). Attention reads
        every slot of the buffers and masks those after `slot`, which must hold finite numbers (`Room.of` zeroes
        them on CUDA). Nothing in it reads a tensor's value on the host."""
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        seen = torch.arange(keys[0].shape[1], device=slot.device) <= slot  # [capacity]
        x = F.embedding(token, self.embed)[0]  # [D]
        for i, layer in enumerate(self.layers):
            h = self._rms(x, layer.norm_in)
            qkv = F.linear(h, layer.qkv.weight, layer.qkv.bias)
            q, k, v = split_heads(qkv, hq, hkv, d, layer.q_norm, layer.k_norm, self.eps, cos, sin)
            keys[i].index_copy_(1, slot, k[:, None])
            values[i].index_copy_(1, slot, v[:, None])
            scores = (q.view(hkv, hq // hkv, d) * self.scale) @ keys[i].transpose(1, 2)  # [H_kv, G, capacity]
            scores = scores.float().masked_fill(~seen, float("-inf"))
            out = torch.softmax(scores, dim=-1).to(v.dtype) @ values[i]  # [H_kv, G, d]
            x = x + F.linear(out.reshape(hq * d), layer.o.weight)
            h = self._rms(x, layer.norm_post)
            gate, up = F.linear(h, layer.gate_up.weight).chunk(2)
            x = x + F.linear(F.silu(gate) * up, layer.down.weight)
        return F.linear(self._rms(x, self.norm), self.lm_head.weight).float()

    def batched(self, cos: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Whether `native.steps` runs several tokens in one pass over the weights here: the C step decodes and
        takes this cache and rotary table [steps, d]."""
        native = self.native
        return native is not None and self.use_native and native.takes(cos[0], keys, values)

    def _compiled_step(
        self,
        token: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        filled: int,
    ) -> torch.Tensor:
        layer_step, head_step = self.compiled  # type: ignore[misc]
        span = -(-(filled + 1) // BLOCK) * BLOCK  # whole blocks of slots, the last one partly filled
        slot = torch.tensor([filled], device=self.embed.device)  # a tensor: a new slot compiles nothing
        x = self.embed[token]  # [D]
        # attention in the C kernel where it takes the cache (an opaque op inside the layer's graph, over the
        # whole buffer), else the graph's own over whole blocks
        kernel = kernel_takes(keys, values, self.heads // self.kv_heads)
        for i, layer in enumerate(self.layers):
            k, v = (keys[i], values[i]) if kernel else (keys[i][:, :span], values[i][:, :span])
            torch._dynamo.maybe_mark_dynamic(k, 1)  # (one block compiles apart: a dimension of 1 is static)
            torch._dynamo.maybe_mark_dynamic(v, 1)
            x = layer_step(
                x,
                layer.norm_in,
                layer.qkv.weight,
                layer.qkv.bias,
                layer.q_norm,
                layer.k_norm,
                layer.o.weight,
                layer.norm_post,
                layer.gate_up.weight,
                layer.down.weight,
                cos,
                sin,
                k,
                v,
                slot,
                self.heads,
                self.eps,
                self.scale,
                kernel,
            )
        logits = head_step(x, self.norm, self.lm_head.weight, self.eps)
        self._compiled_ran = True
        return logits


def decodes_compiled(model: torch.nn.Module) -> bool:
    """Whether `compile_decoding` turned the compiled step on for `model`."""
    return state.of(model).compile_decode


def decodes_native(model: torch.nn.Module) -> bool:
    """Whether `model` decodes through the C step where it takes the model (on unless `native_decoding` turned
    it off)."""
    return state.of(model).native_decode


def native_decoding(model: torch.nn.Module, enabled: bool = True) -> bool:
    """Decode `model` through the whole step in one call, the default: in C on CPU (`kvrag.cpu.cstep.DecodeStep`),
    as a CUDA graph on CUDA (`GraphSteps`); or, with `enabled=False`, through the torch step (compiled where
    `compile_decoding` asked). True where the C step takes the model on this machine."""
    state.of(model).native_decode = enabled
    decoder = decoder_of(model)
    return decoder is not None and decoder.native is not None


WEIGHTS = {"model": None, "int8": 8, "int4": 4}  # what the C step may read: the model's own, or quantized copies


def weights_kind(kind: str) -> str:
    """`kind` where it names weights the C step may read (`WEIGHTS`); else ValueError."""
    if kind not in WEIGHTS:
        raise ValueError(f"decode weights must be one of {', '.join(WEIGHTS)}, not {kind!r}")
    return kind


def decoded_weights(model: torch.nn.Module) -> str:
    """Which weights `decode_weights` asked `model`'s C step to read: "model", "int8" or "int4"."""
    return state.of(model).decode_weights


def weights_read(model: torch.nn.Module) -> str:
    """What decoding `model` reads now: "int8" or "int4" where the C step reads those copies, else "model" (its own
    weights, through the C step or transformers)."""
    held = state.of(model)
    native = held.decoder.native if held.decoder is not None else None
    kind = held.decode_weights
    return kind if kind != "model" and native is not None and native.reads_bits == WEIGHTS[kind] else "model"


def decode_weights(model: torch.nn.Module, kind: str = "model") -> bool:
    """Decode `model` through the C step over its own weights ("model", the default) or over quantized copies of its
    products' weights, "int8" or "int4" (`cstep.DecodeStep.quantize`: made here, once each; about half and a
    quarter of bfloat16's bytes a step; the inputs are quantized per group as well, so the tokens may differ from
    the model's own: docs/performance.md reports how often). The prefill is not changed. True where the C step now
    reads what was asked; False where it does not take it (`DecodeStep.quantized_takes` says why) and decoding
    stays on the model's own weights. It changes the model's state: every runtime on the model decodes so."""
    state.of(model).decode_weights = weights_kind(kind)
    decoder = decoder_of(model)
    native = decoder.native if decoder is not None else None
    return native is not None and native.reads_bits == WEIGHTS[kind] and (kind != "model" or decoder.use_native)


def decode_room(model: torch.nn.Module, tokens: int) -> int:
    """Free cache slots to keep after a prompt for `tokens` decoded ones: BLOCK - 1 more when `model` decodes
    compiled, whose attention reads whole blocks of slots (the extra slots hold no token and take no
    position: they never count against the context)."""
    return tokens + BLOCK - 1 if decodes_compiled(model) and tokens > 1 else tokens


def compile_decoding(model: torch.nn.Module, enabled: bool = True) -> bool:
    """Decode `model` through the compiled step from its next decoded token on (see the module's docstring), or
    with `enabled=False` through the eager step again; every runtime on the model decodes so. False where the fast
    step does not take the model (it then decodes through transformers either way)."""
    state.of(model).compile_decode = enabled
    return decoder_of(model) is not None


def decoder_of(model: torch.nn.Module) -> FastDecoder | None:
    """The model's FastDecoder, made once and kept in the model's state (`kvrag.cpu.state`), set as the state's
    switches say; None when it does not take the model."""
    held = state.of(model)
    decoder = held.decoder
    if decoder is not None and not decoder.current(model):
        decoder = held.decoder = None  # the model's weights were replaced (loaded, cast, moved) since it was made
    if decoder is None and supports(model) is None:
        # made outside inference mode: the fused tensors become the model's weights, which autograd may see
        with torch.inference_mode(False), torch.no_grad():
            decoder = held.decoder = FastDecoder(model)
    if decoder is not None:
        decoder.use_native = held.native_decode
        bits = WEIGHTS[held.decode_weights]
        if decoder.native is not None and bits != getattr(decoder.native, "reads_bits", None):
            decoder.native.quantize(bits)
        if held.compile_decode:
            decoder.compile()
        else:
            decoder.compiled = None
    return decoder
