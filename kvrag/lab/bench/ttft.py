"""Benchmarks that measure time to first token side by side in one process (figures, never asserted in tests).

`run_bench`: for each context size, every strategy's time to first token through the engine (chunk KV in
its memory store), beside two references run in the same process: plain transformers generating one token
from the whole prompt, and the lower bound (one forward of the target and suffix tokens over an already
stitched cache, nothing of kvrag's planning, loading or stitching around it). Phases are timed inside the real
code path (`kvrag.timing`).
In the same rounds, every strategy, full prefill and the model's shipped default (`DEFAULT`) answer with a
fixed number of tokens through the engine, EOS ignored, greedy: the whole answer's time beside its first
token and its decode steps. Storage figures (ingest, store reads, bytes a token, int8 error) are in
`kvrag.lab.bench.storage`; files are written by `kvrag.lab.bench.report`.

A row of `ttft_benchmark` (one context size) holds, beside the time-to-first-token figures:
    answer_tokens: tokens every answer decodes (the first from the prefill, the rest one step each).
    answer_s: name -> median seconds of a whole answer, from the call to its last token.
    answer_ttft_s: name -> median time to first token of those same answers.
    decode_ms: name -> median milliseconds a decode step, (whole - first token) / (answer_tokens - 1).
    answer_speedup: name -> answer_s of full prefill over the name's answer_s, at this context.
    answer_runs_s: name -> every run's whole-answer seconds.
Names are the strategies, FULL_PREFILL where the strategies leave it out, and DEFAULT.
"""

from __future__ import annotations

import contextlib
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
from kvrag.compat import with_cache
from kvrag.engine.documents import split_text
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.lab.demo import sample_docs
from kvrag.lab.roofline import Machine, forward_cost, kv_bytes_per_token
from kvrag.model.encode import length_batches, encode_chunks, prefix_cache
from kvrag.model.catalog import shipped_storage_dtype
from kvrag.kvmodel import KVModel
from kvrag.plan.strategies import BUILTIN_STRATEGIES
from kvrag.model.recompute import stitch_cache, stitch_layout, stitched_forward
from kvrag.timing import Phases

DEFAULT_CONTEXTS = (1000, 2000, 4000, 8000)
BUDGET = 0.05
ANSWER_TOKENS = 32
FULL_PREFILL = "full_prefill"
# The answer a query gets when it names no strategy: the engine's default (kvrag.plan.defaults.shipped_default here).
DEFAULT = "default"
# The phases of a time to first token, in the order they happen; "other" is what no phase covers.
PHASES = ("store load", "plan", "re-positioning", "cache assembly and mask", "forward", "first token")
TRANSFORMERS = "transformers generate"
LOWER_BOUND = "lower bound"
LOWER_BOUND_SUFFIX = "lower bound (suffix only)"
# Forwards over a whole prompt. On this project's machine the first short forward after one ran up to 35 ms
# slower, now and then (at 8k, the suffix-only forward took 0.098 s against 0.064 s just after `generate`, then
# 0.064 again): each is followed by an untimed suffix-only forward, so that no timed answer carries it.
HEAVY = frozenset({FULL_PREFILL, TRANSFORMERS})
# Floors from kvrag.lab.roofline: FLOPs and bytes of the forward each strategy family must run, on this machine.
ROOFLINE = "roofline (target + suffix)"
ROOFLINE_SUFFIX = "roofline (suffix only)"
ROOFLINE_FULL = "roofline (full prefill)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def context_texts(kv: KVModel, tokens: int, chunk_tokens: int) -> list[str]:
    """Chunks of the bundled Python-docs excerpt (`chunk_tokens` each), repeated until they hold `tokens` tokens.

    Repeats carry a copy mark, so every chunk is distinct and has its own stored KV.
    """
    docs, _ = sample_docs()
    pieces = split_text("\n\n".join(d["text"] for d in docs), kv.tokenizer, chunk_tokens=chunk_tokens, overlap=0)
    texts: list[str] = []
    total = 0
    while total < tokens:
        n = len(texts)
        text = pieces[n % len(pieces)] + (f"\n(copy {n // len(pieces)})" if n >= len(pieces) else "")
        texts.append(text)
        total += len(kv.layout.chunk_ids(text))
    return texts


class Context:
    """One context size: the chunks stored in an engine's memory store, the question and the prepared references."""

    def __init__(self, kv: KVModel, rag: KVRAG, texts: list[str], question: str) -> None:
        self.kv, self.rag, self.texts, self.question = kv, rag, texts, question
        self.ids = [kv.layout.chunk_ids(t) for t in texts]
        self.suffix = kv.layout.suffix_ids(question)
        self.device = kv.prefix.keys.device
        rag.store_kv(texts)  # encoded and stored once; not timed
        self.chunks = [rag.store.get(rag.source.key(ids)) for ids in self.ids]  # the engine's own keys

    @property
    def context_tokens(self) -> int:
        return sum(map(len, self.ids))

    def strategy(self, name: str) -> tuple[float, dict[str, float]]:
        """One answer's time to first token through the engine, and its phases."""
        phases = Phases(self.device)
        answer = self.rag.answer(self.question, self.texts, **_options(name), max_new_tokens=1, phases=phases)
        return answer.stats.ttft_s, phases.seconds

    def answer(self, name: str, tokens: int) -> tuple[float, float]:
        """One answer of exactly `tokens` tokens through the engine: its time to first token and its whole time.

        `name` DEFAULT gives no strategy or budget, so the engine runs its default.
        """
        options = _options(name)
        with _past_eos(self.kv):
            answer = self.rag.answer(self.question, self.texts, max_new_tokens=tokens, **options)
        if answer.stats.new_tokens != tokens:
            raise RuntimeError(f"{name} answered {answer.stats.new_tokens} tokens, not the {tokens} asked for")
        return answer.stats.ttft_s, answer.stats.total_s

    def transformers_generate(self) -> Callable[[], float]:
        """What a user runs without kvrag: `generate` one token from the whole prompt."""
        ids = torch.tensor([self.kv.prompt_ids(self.question, self.ids, range(len(self.ids)))], device=self.device)
        pad = self.kv.tokenizer.pad_token_id or self.kv.eos_ids[0]

        @torch.inference_mode()
        def run() -> float:
            _sync(self.device)
            t0 = time.perf_counter()
            self.kv.model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=pad)
            _sync(self.device)
            return time.perf_counter() - t0

        return run

    def lower_bound(self, recompute_target: bool) -> Callable[[], float]:
        """One forward of the target's and the suffix's tokens (or the suffix's alone) over a ready cache.

        Everything else is prepared beforehand: the reused KV re-positioned into a stitched cache with room for
        the new tokens (the cache the engine's forward runs on: the new tokens' KV is written into the room, no
        layer's KV is copied), ids and positions; each run starts from the same filled slots. The forward is the
        engine's (`stitched_forward`: in one C call where it takes the model, else the model's own with its 4-D
        mask made as the engine makes it).
        """
        kv, n = self.kv, len(self.chunks)
        order = [*range(1, n), 0] if recompute_target else list(range(n))
        S = {0: torch.arange(len(self.chunks[0]))} if recompute_target else {}
        lengths, starts = [len(c) for c in self.chunks], [c.start for c in self.chunks]
        layout = stitch_layout(len(kv.prefix), lengths, starts, order, S, len(self.suffix), self.device)
        new_ids = ([*self.ids[0]] if recompute_target else []) + self.suffix
        built = stitch_cache(kv.repositioner, kv.prefix, self.chunks, order, S, layout, room=len(new_ids))
        filled = built.layers[0].keys.shape[-2]
        input_ids = torch.tensor([new_ids], device=self.device)

        @torch.inference_mode()
        def run() -> float:
            cache = built.refilled(filled)  # the room's slots are written again each run
            _sync(self.device)
            t0 = time.perf_counter()
            # the forward the engine runs (the 4-D mask made in it, as the engine makes it, where the model's runs)
            stitched_forward(kv.model, cache, input_ids, layout.query_positions, layout.key_positions)
            _sync(self.device)
            return time.perf_counter() - t0

        return run


def _options(name: str) -> dict[str, Any]:
    """A row's request: a strategy whose target is the first chunk (the oracle), or NAME:PICKER, whose picker
    chooses it as a user's query would (the chunks come unscored, best first)."""
    if name == DEFAULT:  # no strategy, picker or budget: the engine runs its default
        return {"target": 0}
    strategy, _, picker = name.partition(":")
    return {"strategy": strategy, "budget": BUDGET, "target": 0} | ({"picker": picker} if picker else {})


@contextlib.contextmanager
def _past_eos(kv: KVModel) -> Iterator[None]:
    """No token ends an answer: the engine has no switch for it, and answers compared must be one length."""
    eos, kv.eos_ids = kv.eos_ids, []
    try:
        yield
    finally:
        kv.eos_ids = eos


_EARLIER_MB: dict[str, float] = {}  # high-water marks from before the last reset: a reset never lowers the run's


def _high_water_mb(device: torch.device | None) -> dict[str, float]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = {"rss_high_water_mb": rss / (1 << 20) if sys.platform == "darwin" else rss / 1024}
    if device is not None and device.type == "cuda":
        peak["cuda_max_allocated_mb"] = torch.cuda.max_memory_allocated(device) / (1 << 20)
    return peak


def peak_memory(device: torch.device | None = None, *, since_reset: bool = False) -> dict[str, float]:
    """The process's memory high-water mark (ru_maxrss, MiB), and on CUDA the most the device held: over the whole
    run, or since the last `reset_peak_memory` (where the system let it reset the mark: `peak_scope`)."""
    now = _high_water_mb(device)
    if since_reset:
        return now
    return {k: max(v, _EARLIER_MB.get(k, 0.0)) for k, v in now.items()}


def reset_peak_memory(device: torch.device | None = None) -> None:
    """Start a new high-water mark for `peak_memory(since_reset=True)`, keeping the whole run's: Linux resets a
    process's resident high-water mark through /proc/self/clear_refs, CUDA its peak statistics."""
    for k, v in _high_water_mb(device).items():
        _EARLIER_MB[k] = max(v, _EARLIER_MB.get(k, 0.0))
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the marks stay the whole run's
        _EARLIER_MB.clear()


def peak_scope() -> str:
    """What `peak_memory(since_reset=True)` covers: "size" after a reset the system made, else "run"."""
    return "size" if _EARLIER_MB else "run"


def fits(kv: KVModel, tokens: int, answer_tokens: int) -> str | None:
    """Why a context of `tokens` cannot be benched on this machine, or None: the model's positions, then memory.

    The memory asked is an estimate, on the large side: the context's KV four times (the engine's store, a
    stitched cache, full prefill's and transformers' caches), full prefill's activations over the whole prompt
    (its MLP's three intermediate tensors and four of the hidden size, a token each) and a dense attention mask,
    against what the system has free now (MemAvailable; on CUDA the device's free memory).
    """
    positions = len(kv.prefix) + tokens + 64 + answer_tokens  # 64: the question and the assistant's header
    if positions > kv.max_positions:
        return (f"a context of {tokens:,} tokens needs about {positions:,} positions with its question and answer; "
                f"the model takes {kv.max_positions:,}")
    config = kv.model.config
    element = kv.prefix.keys.element_size()
    total = len(kv.prefix) + tokens + 64
    need = (
        4 * kv_bytes_per_token(kv) * total
        + total * (3 * getattr(config, "intermediate_size", 4 * config.hidden_size) + 4 * config.hidden_size) * element
        + 4 * total * total
    )
    free = _free_bytes(kv.prefix.keys.device)
    if free is not None and need > free:
        return (f"a context of {tokens:,} tokens needs about {need / (1 << 30):.1f} GiB beside the model, "
                f"{free / (1 << 30):.1f} GiB are free")
    return None


def _free_bytes(device: torch.device) -> int | None:
    """Bytes free for this process's next allocations (None where the system does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_memory_line(device: torch.device | None = None) -> str:
    """`peak_memory` as the line every bench ends its output with."""
    peak = peak_memory(device)
    line = f"peak memory: {peak['rss_high_water_mb']:,.0f} MiB resident (the process's high-water mark, ru_maxrss)"
    if "cuda_max_allocated_mb" in peak:
        line += f", {peak['cuda_max_allocated_mb']:,.0f} MiB allocated on the GPU at most"
    return line


def ttft_benchmark(
    kv: KVModel,
    rag: KVRAG,
    *,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    chunk_tokens: int = 200,
    strategies: Sequence[str] = BUILTIN_STRATEGIES,
    runs: int = 5,
    answer_tokens: int = ANSWER_TOKENS,
    log: Callable[[str], None] = print,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
    on_skip: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Time to first token of every strategy and of both references at each context size (median of `runs`),
    and the whole time of an `answer_tokens`-token answer of every strategy, full prefill and the default.

    One warm-up of everything at the first size; then, size by size, `runs` rounds, each running every
    strategy, reference and answer once (interleaved, so a slow spell of the machine touches all of them alike),
    each forward over a whole prompt followed by an untimed suffix-only forward (HEAVY).
    A size that does not fit the model's positions or this machine's free memory (`fits`) is logged, handed to
    `on_skip` and not measured. Each row's peak memory is its size's (`reset_peak_memory` before it).
    Long by design: every path is timed inside one interleaved loop (a slow spell of the machine
    touches all alike), which splitting would scatter.
    """
    if answer_tokens < 2:
        raise ValueError(f"answer_tokens must be at least 2 (a first token and a decode step), got {answer_tokens}")
    answered = list(dict.fromkeys([*strategies, FULL_PREFILL, DEFAULT]))
    _, questions = sample_docs()
    question = questions[0]["question"]
    device = kv.prefix.keys.device
    machine = Machine.calibrate(kv.prefix.keys.dtype, device)
    log(f"roofline calibration: {machine.matmul_flops / 1e9:.0f} GFLOP/s, {machine.read_bytes / 1e9:.1f} GB/s")
    rows = []
    for size in contexts:
        reason = fits(kv, size, answer_tokens)
        if reason is not None:
            log(f"{size:>6} context tokens: not measured: {reason}")
            if on_skip is not None:
                on_skip({"context_tokens": size, "reason": reason})
            continue
        first = not rows
        reset_peak_memory(device)
        ctx = Context(kv, rag, context_texts(kv, size, chunk_tokens), question)
        references = {
            TRANSFORMERS: ctx.transformers_generate(),
            LOWER_BOUND: ctx.lower_bound(recompute_target=True),
            LOWER_BOUND_SUFFIX: ctx.lower_bound(recompute_target=False),
        }
        if first:  # warm-up: every code path once
            for name in strategies:
                ctx.strategy(name)
            for run in references.values():
                run()
            for name in answered:
                ctx.answer(name, answer_tokens)
        times: dict[str, list[float]] = {name: [] for name in [*strategies, *references]}
        phases: dict[str, list[dict[str, float]]] = {name: [] for name in strategies}
        answers: dict[str, list[tuple[float, float]]] = {name: [] for name in answered}
        settle = references[LOWER_BOUND_SUFFIX]  # run untimed after each forward over a whole prompt (HEAVY)
        for _ in range(runs):
            for name in strategies:
                ttft, spent = ctx.strategy(name)
                times[name].append(ttft)
                phases[name].append(spent)
                if name in HEAVY:
                    settle()
            for name, run in references.items():
                times[name].append(run())
                if name in HEAVY:
                    settle()
            for name in answered:
                answers[name].append(ctx.answer(name, answer_tokens))
                if name in HEAVY:
                    settle()
        # calibrated again after the rounds, the best of every calibration so far kept: the floor is the least
        # time, and one calibration can fall in a slow spell of a shared machine
        machine = machine.best(Machine.calibrate(kv.prefix.keys.dtype, device))
        row = _row(ctx, times, phases, device, machine) | _answer_fields(answers, answer_tokens)
        rows.append(row)
        if on_row is not None:
            on_row(rows)  # a long run keeps what it measured so far
        t = row["ttft_s"]
        log(
            f"{'':>6} roofline calibration, best so far: {machine.matmul_flops / 1e9:.0f} GFLOP/s, "
            f"{machine.read_bytes / 1e9:.1f} GB/s"
        )
        log(
            f"{row['context_tokens']:>6} context tokens: "
            + ", ".join(f"{name} {t[name]:.3f} s" for name in [*strategies, *references])
        )
        log(
            f"{'':>6} {answer_tokens}-token answer: "
            + ", ".join(
                f"{name} {row['answer_s'][name]:.3f} s ({row['decode_ms'][name]:.1f} ms/token)" for name in answered
            )
        )
    return rows


def _row(
    ctx: Context,
    times: dict[str, list[float]],
    phases: dict[str, list[dict[str, float]]],
    device: Any,
    machine: Machine,
) -> dict:
    """One context size's figures: medians of every strategy and reference, their floors, phases, peak memory."""
    kv = ctx.kv
    prefix, target, suffix = len(kv.prefix), len(ctx.ids[0]), len(ctx.suffix)
    floors = {
        ROOFLINE: forward_cost(kv, target + suffix, prefix + ctx.context_tokens - target),
        ROOFLINE_SUFFIX: forward_cost(kv, suffix, prefix + ctx.context_tokens),
        ROOFLINE_FULL: forward_cost(kv, prefix + ctx.context_tokens + suffix),
    }
    return {
        "floor_s": {name: cost.floor(machine) for name, cost in floors.items()},
        "machine": machine.to_dict(),
        "context_tokens": ctx.context_tokens,
        "chunks": len(ctx.texts),
        "target_tokens": len(ctx.ids[0]),
        "suffix_tokens": len(ctx.suffix),
        "prompt_tokens": len(kv.prefix) + ctx.context_tokens + len(ctx.suffix),
        "ttft_s": {name: statistics.median(t) for name, t in times.items()},
        "runs_s": times,
        "phases_s": {name: _median_phases(p, times[name]) for name, p in phases.items()},
        "peak_memory": peak_memory(device, since_reset=True),  # this size's high-water mark
        "peak_scope": peak_scope(),  # "run" where the mark could not be reset: the run's so far
    }


def _answer_fields(answers: dict[str, list[tuple[float, float]]], tokens: int) -> dict[str, Any]:
    """The whole-answer figures of one context size from each name's (first token, whole) seconds a run."""
    whole = {name: statistics.median(total for _, total in runs) for name, runs in answers.items()}
    return {
        "answer_tokens": tokens,
        "answer_s": whole,
        "answer_ttft_s": {name: statistics.median(ttft for ttft, _ in runs) for name, runs in answers.items()},
        "decode_ms": {
            name: statistics.median(1000 * (total - ttft) / (tokens - 1) for ttft, total in runs)
            for name, runs in answers.items()
        },
        "answer_speedup": {name: whole[FULL_PREFILL] / s for name, s in whole.items()},
        "answer_runs_s": {name: [total for _, total in runs] for name, runs in answers.items()},
    }


def _median_phases(runs: list[dict[str, float]], ttfts: list[float]) -> dict[str, float]:
    """Per phase, the median over runs; "other" is the median of what the phases leave of each run's ttft."""
    out = {name: statistics.median(r.get(name, 0.0) for r in runs) for name in PHASES}
    out["other"] = statistics.median(max(0.0, t - sum(r.values())) for r, t in zip(runs, ttfts))
    return out


@torch.inference_mode()
def raw_forward(kv: KVModel, chunk_ids: list[list[int]]) -> None:
    """The least work encoding can be: the same batched forwards behind the prefix, nothing extracted or kept."""
    device = kv.prefix.keys.device
    start = len(kv.prefix)
    for group in length_batches([len(c) for c in chunk_ids], kv.batch_tokens):
        width = max(len(chunk_ids[i]) for i in group)
        ids = torch.zeros((len(group), width), dtype=torch.long, device=device)
        for row, i in enumerate(group):
            ids[row, : len(chunk_ids[i])] = torch.as_tensor(chunk_ids[i])
        positions = torch.arange(start, start + width, device=device).expand(len(group), -1)
        kv.model(
            input_ids=ids,
            position_ids=positions,
            **with_cache(kv.model, prefix_cache(kv.prefix, len(group))),
            use_cache=True,
            logits_to_keep=1,
        )


def _interleaved_times(paths: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    """Seconds of each path in `runs` rounds after a warm-up, each round running every path once: a slow spell of
    a shared machine touches all of them alike, so their ratios hold where their times do not."""
    for fn in paths.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(runs):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def ingest_ratio(x_raw: dict[str, float]) -> str:
    """The line that says how close ingestion comes to the model's raw batched forward (its tokens a second)."""
    rows = [name for name in x_raw if name.startswith("ingest")]
    return "ingestion at " + ", ".join(f"{x_raw[n]:.2f}x ({n.removeprefix('ingest, ')})" for n in rows) + (
        " the raw batched forward's tokens a second"
    )


def ingest_benchmark(
    kv: KVModel,
    *,
    copies: int = 3,
    runs: int = 3,
    embedder: Embedder | None = None,
    texts: Sequence[str] | None = None,
    print_fn: Callable[[str], None] = print,
) -> dict:
    """Chunks/s and tokens/s of raw forward, kvrag encoding (alone, and in its document's context), and ingestion
    into memory and disk stores.

    The chunks are `texts` (one document for the in-context row), or else `copies` copies of the bundled excerpt's
    chunks (a copy a document).
    """
    texts_given = texts
    if texts is None:
        chunks, _ = sample_docs()
        texts = [f"{c['text']}\n(copy {n})" for n in range(copies) for c in chunks]
    ids = [kv.chunk_ids(i, t) for i, t in enumerate(texts)]
    tokens = sum(map(len, ids))
    embedder = embedder or Embedder()
    per_copy = len(ids) // max(copies, 1) if texts_given is None else len(ids)
    documents = [ids[n : n + per_copy] for n in range(0, len(ids), max(per_copy, 1))]
    in_context = [[doc[i] for i in run] for doc in documents for run in kv.context_runs(doc)]
    stored = shipped_storage_dtype(kv.fingerprint.weights)

    def ingest(store_factory: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            rag = KVRAG(kv, embedder=embedder, store=store_factory())
            rag.ingest(texts, split=False, progress=False)

        return run

    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(10**6))
        paths: dict[str, Callable[[], Any]] = {
            "raw batched forward": lambda: raw_forward(kv, ids),
            "kvrag encode_chunks": lambda: encode_chunks(
                kv.model, kv.chunk_prefix, ids, batch_tokens=kv.batch_tokens, encoder=kv.encoder_id
            ),
            # the same chunks, a copy of the excerpt a document, each chunk behind its document's earlier ones
            "kvrag encode in context": lambda: kv.encode_runs_ids(in_context),
            "ingest, memory store": ingest(MemoryStore),
            # the disk store in the storage dtype a new index of this model writes (k4v3 on the 0.5B and the 1.5B)
            f"ingest, memory + disk ({stored})": ingest(
                lambda: TieredStore(MemoryStore(), DiskStore(f"{tmp}/{next(counter)}", stored))
            ),
        }
        times = _interleaved_times(paths, runs)
    results = {name: statistics.median(t) for name, t in times.items()}
    raw_runs = times["raw batched forward"]
    # each round's ratio to the raw forward timed beside it, then their median: steadier than a ratio of medians
    x_raw = {name: statistics.median(r / s for r, s in zip(raw_runs, t)) for name, t in times.items()}
    print_fn(
        f"{len(texts)} chunks, {tokens} tokens, batch_tokens {kv.batch_tokens}, {torch.get_num_threads()} threads, "
        f"median of {runs} interleaved rounds after a warm-up"
    )
    print_fn(f"{'':<30}{'seconds':>9}{'chunks/s':>10}{'tokens/s':>10}{'x raw':>8}")
    for name, seconds in results.items():
        print_fn(
            f"{name:<30}{seconds:>9.3f}{len(texts) / seconds:>10.1f}{tokens / seconds:>10.0f}{x_raw[name]:>8.2f}"
        )
    print_fn(ingest_ratio(x_raw))
    return {
        "chunks": len(texts),
        "tokens": tokens,
        "runs": runs,
        "seconds": results,
        "runs_s": times,
        "tokens_per_s": {name: tokens / s for name, s in results.items()},
        "x_raw": x_raw,
    }
