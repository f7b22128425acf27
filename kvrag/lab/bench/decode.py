"""`kvrag bench-decode`: milliseconds a decoded token after a kvrag prefill, beside the transformers forward step
and the floor the machine's memory bandwidth sets.

A decode step must read every weight and every cached key and value once; nothing is faster than those bytes
over the bandwidth measured here (`kvrag.lab.roofline`: a step's FLOPs are far below what the matmul rate allows).
Each size is measured
side by side in one run: kvrag's step in C (`kvrag`, what decodes by default where the C kernels build), its
torch step eager (`kvrag_torch`) and compiled (`kvrag_compiled`, `compile_decoding`; the compile itself is timed
apart, in the warm-up), the transformers forward step over the same cache, and the floor.

Two more pairs time the C step with prompt-lookup drafts (`kvrag.run.generate.PromptLookup`, the default in an
answer) and without, over the same answers: `kvrag_lookup` beside `kvrag` on the bench's question, and
`kvrag_lookup_quote` beside `kvrag_quote` on an answer that copies a chunk (QUOTE), the kind of answer drafts
are for. Their tokens are the same; a token costs less than a step where drafts are confirmed, so these rows can
sit below the floor, which prices one step.

`kvrag_int8` and `kvrag_int4` time the C step over int8 and int4 copies of the weights (`kvrag.cpu.decode_weights`),
beside `kvrag`, and `memory_read_int8`, `memory_read_int4` are their own floors: the read of the bytes those steps
must read (the quantized weights, their scales and offsets, in place of the model's); their `over_read` is against
that read. Their tokens may differ from `kvrag`'s (docs/performance.md reports how often).

`kvrag_small_pages` times the C step over a copy of its weights in ordinary 4 KB pages, beside `kvrag`, whose
weights the decoder keeps on 2 MB pages where the system gives them (`kvrag.cpu.hugepages`).

`memory_read` is the floor measured in the same rounds: the time to read, front to back (`kernels/stream_read.c`,
from huge pages), as many bytes as a step must (every weight, every cached key and value). The machine's read
rate moves by up to 2x within minutes here, with what else it runs; a calibration before and after the rounds
can land in a fast spell and the steps in a slow one, or the other way round (the step then comes out below its
"floor"). Each row is therefore also shown against this paired read (`over_read`).
"""

from __future__ import annotations

import copy
import functools
import time
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import torch

from kvrag.cache.kv import ChunkKV
from kvrag.cpu import ckernel, cstep, hugepages
from kvrag.cpu.decode import (
    compile_decoding,
    decoder_of,
    decodes_compiled,
    decode_weights,
    decoded_weights,
    decodes_native,
    native_decoding,
)
from kvrag.lab.bench.ttft import context_texts, peak_memory, peak_memory_line
from kvrag.lab.demo import sample_docs
from kvrag.lab.roofline import Machine, forward_cost
from kvrag.kvmodel import KVModel
from kvrag.run import pipeline
from kvrag.run.generate import Sampling, decode

QUOTE = "Copy the last paragraph above word for word."  # the question of the `_quote` rows
# Every path `decode_benchmark` may time (those the model and machine take), in the order each round runs them.
ROWS = (
    "transformers_step", "kvrag", "kvrag_lookup", "kvrag_quote", "kvrag_lookup_quote", "kvrag_int8", "kvrag_int4",
    "kvrag_small_pages", "kvrag_torch", "kvrag_compiled", "memory_read", "memory_read_int8", "memory_read_int4",
)


def _decode_time(
    kv: KVModel, question: str, encoded: list[ChunkKV], tokens: int, fast: bool, lookup: bool = False
) -> tuple[float, int, int]:
    """Seconds a token over `tokens` greedy tokens after a target_recompute prefill (one step each, or with
    prompt-lookup drafts); the cached tokens; the tokens decoded."""
    request = kv.request(question, encoded, strategy="target_recompute", max_new_tokens=tokens)
    chunks = kv.source.chunks(request.chunks)
    run = pipeline.prefill(kv, request, chunks, kv.executor, room=tokens, pooled=True)
    prefill = run.prefill
    sampling = Sampling(max_new_tokens=tokens, prompt_lookup=Sampling().prompt_lookup if lookup else 0)
    context = (prefill.prompt_ids or ()) if lookup else ()
    steps = decode(
        kv.model,
        prefill.cache,
        prefill.logits[-1],
        prefill.next_position,
        sampling,
        (),
        fast_decoding=fast,
        context=context,
    )
    next(steps)  # the first token comes from the prefill's logits: not a step
    t0 = time.perf_counter()
    count = sum(1 for _ in steps)
    seconds = time.perf_counter() - t0
    kv.executor.release(prefill)
    return seconds / max(count, 1), prefill.next_position, count


def decode_benchmark(
    kv: KVModel,
    *,
    contexts: Sequence[int] = (1000, 4000),
    tokens: int = 32,
    runs: int = 3,
    rows: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Per context size: ms a token for kvrag's eager and compiled steps and the transformers forward (median of
    `runs`, interleaved), and the bandwidth floor; the ratios are to that floor. Where the fast step does not
    take the model, only the transformers forward is timed. `rows` names the paths to time (default every one:
    ROWS); the int8 and int4 copies of the weights are made only for rows that read them.
    Long by design: every path is timed inside one interleaved loop (a slow spell of the machine
    touches all alike), which splitting would scatter."""
    _, questions = sample_docs()
    question = questions[0]["question"]
    machine = Machine.calibrate(kv.prefix.keys.dtype, kv.prefix.keys.device)
    bandwidth = machine.read_bytes
    fast = decoder_of(kv.model) is not None
    wanted = set(ROWS if rows is None else rows)
    if wanted - set(ROWS):
        raise ValueError(f"unknown decode rows {sorted(wanted - set(ROWS))}: name some of {', '.join(ROWS)}")
    log(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; fast step: {'yes' if fast else 'no'}")
    compiled_before, native_before = decodes_compiled(kv.model), decodes_native(kv.model)
    weights_before = decoded_weights(kv.model)
    decode_weights(kv.model, "model")  # `kvrag` is the model's own weights; `kvrag_int8`, `_int4` quantized ones
    paths: dict[str, Callable[[int], tuple[float, int, int]]] = {
        "transformers_step": lambda n: _decode_time(kv, question, texts, n, False)
    }
    saved: dict[str, int] = {}  # bytes a step over int8 or int4 weights reads less than one over the model's
    if fast:
        if native_decoding(kv.model, True):
            paths["kvrag"] = lambda n: _on_step(kv, True, False, lambda: _decode_time(kv, question, texts, n, True))
            for name, asked in (("", question), ("_quote", QUOTE)):
                if name:
                    paths["kvrag" + name] = functools.partial(_native, kv, asked, lambda: texts, False)
                paths["kvrag_lookup" + name] = functools.partial(_native, kv, asked, lambda: texts, True)
            for kind in ("int8", "int4"):
                if {"kvrag_" + kind, "memory_read_" + kind} & wanted and decode_weights(kv.model, kind):
                    saved[kind] = _saved_bytes(decoder_of(kv.model).native, int(kind[3:]))
                    made = decoder_of(kv.model).native.made_s[int(kind[3:])]
                    log(f"{kind} copies of the weights: made in {made:.2f} s")
                    paths["kvrag_" + kind] = functools.partial(_on_weights, kv, kind, question, lambda: texts)
            decode_weights(kv.model, "model")
            if decoder_of(kv.model).native is not None:
                paths["kvrag_small_pages"] = lambda n: _on_small_pages(
                    kv, lambda: _on_step(kv, True, False, lambda: _decode_time(kv, question, texts, n, True))
                )
        elif decoder_of(kv.model).graphs is not None:  # on CUDA the default step is the captured graph
            paths["kvrag"] = lambda n: _on_step(kv, True, False, lambda: _decode_time(kv, question, texts, n, True))
        paths["kvrag_torch"] = lambda n: _on_step(kv, False, False, lambda: _decode_time(kv, question, texts, n, True))
        paths["kvrag_compiled"] = lambda n: _on_step(
            kv, False, True, lambda: _decode_time(kv, question, texts, n, True)
        )
    reader = _MemoryRead(kv)
    quantized_readers: dict[str, _MemoryRead] = {}
    if reader.runs():
        paths["memory_read"] = reader
        quantized_readers = {kind: _MemoryRead(kv, less=less, shared=reader) for kind, less in saved.items()}
        paths.update({"memory_read_" + kind: r for kind, r in quantized_readers.items()})
    paths = {name: path for name, path in paths.items() if name in wanted}
    out = []
    compile_s = None
    try:
        for size in contexts:
            texts = kv.encode(context_texts(kv, size, 200))  # encoded once: only the prefill and decoding repeat
            for name, path in paths.items():  # warm-up of every path (the compile happens in the first one)
                t0 = time.perf_counter()
                reader.cached = max(reader.cached, path(4)[1])
                for quantized_reader in quantized_readers.values():
                    quantized_reader.cached = reader.cached
                if name == "kvrag_compiled" and compile_s is None:
                    compile_s = time.perf_counter() - t0
            reader.release()
            times: dict[str, list[float]] = {name: [] for name in paths}
            cached = 0
            for _ in range(runs):
                for name, path in paths.items():
                    t, cached, _steps = path(tokens)
                    times[name].append(t)
                reader.release()  # a round's reads are over: the next round's small-pages copy never meets it
            machine = machine.best(Machine.calibrate(kv.prefix.keys.dtype, kv.prefix.keys.device))  # the best so far
            out.append(_row(kv, machine, times, cached, tokens, compile_s, log))
            reader.cached = 0
    finally:
        compile_decoding(kv.model, compiled_before)
        native_decoding(kv.model, native_before)
        decode_weights(kv.model, weights_before)
    return out


def _saved_bytes(step: cstep.DecodeStep, bits: int) -> int:
    """Bytes a step over `bits`-bit weights reads less than one over the model's: the products' weights in the
    model's dtype less their quantized values, scales and offsets."""
    own = step._decoder.lm_head.weight.nbytes
    products = ("qkv", "o", "gate_up", "down")
    own += sum(getattr(layer, n).weight.nbytes for layer in step._decoder.layers for n in products)
    return own - step.quantized_bytes(bits)


def _on_weights(
    kv: KVModel, kind: str, question: str, texts: Callable[[], list[ChunkKV]], tokens: int
) -> tuple[float, int, int]:
    """The C step's seconds a token over `kind` weights ("int8", "int4"), then back on the model's own."""
    native_decoding(kv.model, True)
    compile_decoding(kv.model, False)
    decode_weights(kv.model, kind)
    try:
        return _decode_time(kv, question, texts(), tokens, True)
    finally:
        decode_weights(kv.model, "model")


def _native(
    kv: KVModel, question: str, texts: Callable[[], list[ChunkKV]], lookup: bool, tokens: int
) -> tuple[float, int, int]:
    """The C step's seconds a token, with or without prompt-lookup drafts."""
    return _on_step(kv, True, False, lambda: _decode_time(kv, question, texts(), tokens, True, lookup))


class _MemoryRead:
    """A path that reads, front to back, the bytes a step in the middle of the answer must read, from huge pages,
    in C: the seconds of one read, in place of a token's.

    The readers of quantized steps read the front of the model's reader's buffer (`shared`): one buffer, as large as
    the weights, for them all. It is made at a round's first read and let go after its last (`release`), so that it
    never shares the peak with the small-pages copy of the weights.
    """

    def __init__(self, kv: KVModel, less: int = 0, shared: _MemoryRead | None = None) -> None:
        self.kv, self.cached, self.buffer, self.less, self.shared = kv, 0, torch.empty(0), less, shared

    def runs(self) -> bool:
        return self.kv.prefix.keys.device.type == "cpu" and ckernel.available()

    def release(self) -> None:
        self.buffer = torch.empty(0)

    def __call__(self, tokens: int) -> tuple[float, int, int]:
        count = int(forward_cost(self.kv, 1, self.cached + tokens // 2).bytes - self.less) // 256 * 64  # 256 B a loop
        buffer = (self.shared or self).holding(count)[:count]
        t0 = time.perf_counter()
        ckernel.stream_read(buffer)
        return time.perf_counter() - t0, self.cached, tokens

    def holding(self, count: int) -> torch.Tensor:
        """This reader's buffer, grown to `count` floats at least (a fresh one where it was released or short)."""
        if self.buffer.numel() < count:
            self.buffer = torch.empty(0)  # the old one goes first: never two at once
            self.buffer = hugepages.empty((count,), torch.float32).fill_(1)
        return self.buffer


def _on_small_pages(kv: KVModel, run: Callable[[], tuple[float, int, int]]) -> tuple[float, int, int]:
    """`run` with the model's C step over a copy of its weights in ordinary pages, made for this run and let go
    after it (a whole copy of the weights: kept, it would sit on the bench's peak memory beside every other)."""
    decoder = decoder_of(kv.model)
    shared = ("heads", "kv_heads", "head_dim", "norm", "eps", "scale")
    copied = SimpleNamespace(**{name: getattr(decoder, name) for name in shared})
    copied.embed = _small(decoder.embed)
    tied = decoder.lm_head.weight.data_ptr() == decoder.embed.data_ptr()  # one copy of tied embeddings, as the model
    copied.lm_head = SimpleNamespace(weight=copied.embed if tied else _small(decoder.lm_head.weight))
    copied.layers = [copy.copy(layer) for layer in decoder.layers]
    for own in copied.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            product = getattr(own, name)
            setattr(own, name, SimpleNamespace(weight=_small(product.weight), bias=product.bias))
    step = cstep.DecodeStep.of(copied)
    del copied
    if step is None:
        raise RuntimeError("the C step did not take a small-pages copy of weights it takes on huge pages")
    return _with_step(kv, step, run)


def _small(tensor: torch.Tensor) -> torch.Tensor:
    return hugepages.empty(tensor.shape, tensor.dtype, huge=False).copy_(tensor)


def _with_step(
    kv: KVModel, step: cstep.DecodeStep, run: Callable[[], tuple[float, int, int]]
) -> tuple[float, int, int]:
    """`run` with the model's decoder on another C step over the same shapes."""
    decoder = decoder_of(kv.model)
    own, decoder.native = decoder.native, step
    try:
        return run()
    finally:
        decoder.native = own


def _on_step(
    kv: KVModel, native: bool, compiled: bool, run: Callable[[], tuple[float, int, int]]
) -> tuple[float, int, int]:
    """`run` with the model on the C step, or on the torch step eager or compiled."""
    native_decoding(kv.model, native)
    compile_decoding(kv.model, compiled)
    return run()


def _row(
    kv: KVModel,
    machine: Machine,
    times: dict[str, list[float]],
    cached: int,
    tokens: int,
    compile_s: float | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """One size's row: the median ms a token of each path, and each as a ratio to the floor."""
    floor = forward_cost(kv, 1, cached + tokens // 2).floor(machine)  # a step in the middle of the answer
    ms = {name: 1000 * sorted(v)[len(v) // 2] for name, v in times.items()}
    read = ms.get("memory_read")
    reads = {name: ms.get("memory_read_" + name[-4:], read) if name[-4:] in ("int8", "int4") else read for name in ms}
    row = {
        "context_tokens": cached,
        "ms_per_token": ms,
        "floor_ms": 1000 * floor,
        "over_floor": {name: m / (1000 * floor) for name, m in ms.items()},
        "over_read": {name: m / reads[name] for name, m in ms.items()} if read else None,
        "bandwidth_gb_s": machine.read_bytes / 1e9,
        "compile_s": compile_s,
        "peak_memory": peak_memory(kv.prefix.keys.device),  # the process's high-water mark so far
    }
    shown = ", ".join(f"{name} {m:.1f} ms/token ({m / (1000 * floor):.2f}x)" for name, m in ms.items())
    log(f"{cached:>6} cached tokens: floor {1000 * floor:.1f} ms ({machine.read_bytes / 1e9:.1f} GB/s); {shown}")
    if read:
        paired = ", ".join(f"{name} {m / reads[name]:.2f}x" for name, m in ms.items() if not name.startswith("memory"))
        log(f"{'':>6} against the paired read of the same bytes ({read:.1f} ms): {paired}")
    log(f"{'':>6} {peak_memory_line(kv.prefix.keys.device)}")
    return row
