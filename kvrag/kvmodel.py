"""KVModel: a causal LM that encodes chunks once and answers over their stored KV (the facade).

This is the public surface the retrieval engine, the adapters and users build on: encode chunk texts to chunk KV,
and answer a question over a caller-given list of chunks (texts or their KV) with any registered strategy. The
model itself (loading, layout, prefix KV, encoding, chunk keys, lock) is its `ModelRuntime`
(`kvrag.model.runtime`); an answer goes through `kvrag.run.pipeline` (plan, execute, decode). Here, and in the
engine, the request's default is applied, once. It never retrieves.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

from kvrag.answer import Answer, last_answer
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.kv import ChunkKV
from kvrag.model.encode import DEFAULT_BATCH_TOKENS
from kvrag.model.layout import PromptLayout
from kvrag.model.runtime import DEFAULT_LEAD, MASK_ATTENTION, ModelRuntime, model_lock  # noqa: F401 - as before
from kvrag.plan.defaults import default_parts, shipped_default
from kvrag.plan.parts import resolve_parts
from kvrag.plan.probe import Probe
from kvrag.plan.request import Request
from kvrag.run import parts as run_parts
from kvrag.run import pipeline
from kvrag.run.executor import HFExecutor
from kvrag.run.pipeline import Prefilled
from kvrag.timing import Phases

class KVModel(ModelRuntime):
    """A causal LM wrapper that reuses per-chunk KV: the model runtime (`ModelRuntime`: loading, encoding, chunk
    keys) with the answering methods on top, and an in-process executor and chunk source of its own.

    Args: those of `kvrag.model.runtime.ModelRuntime` (model, tokenizer, weights_id, layout, batch_tokens, lead,
    compile_decode, decode_weights, cpu_kernels).

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
        compile_decode: bool = False,
        decode_weights: str | None = None,
        cpu_kernels: bool = True,
    ) -> None:
        super().__init__(
            model,
            tokenizer,
            weights_id=weights_id,
            layout=layout,
            batch_tokens=batch_tokens,
            lead=lead,
            compile_decode=compile_decode,
            decode_weights=decode_weights,
            cpu_kernels=cpu_kernels,
        )
        self.executor = HFExecutor(self)  # runs plans in-process (its stitched-cache buffers serve one answer a time)
        self.source = ChunkSource(self)  # chunk KV for requests that give texts: encoded, no store

    # -- answering --------------------------------------------------------------------------------------

    def request(self, question: str, chunks: Sequence[str | ChunkKV], **options: Any) -> Request:
        """The `Request` that `stream`'s keyword arguments describe (validated here, once), with the model's shipped
        default (`kvrag.plan.defaults`) where it names no strategy: the one place a KVModel request gets it."""
        return self.with_default(Request.of(question, chunks, **options))

    def with_default(self, request: Request) -> Request:
        """`request` with this model's shipped default where it names no strategy (`Request.with_default`)."""
        return request.with_default(shipped_default(self.fingerprint.weights))

    def prefill(
        self,
        request: Request | str,
        chunks: Sequence[str | ChunkKV] = (),
        *,
        room: int = 0,
        logits_to_keep: int = 1,
        phases: Phases | None = None,
        probe: type[Probe] = Probe,
        **options: Any,
    ) -> Prefilled:
        """Plan a request and run its prefill only: what `stream` decodes on, and what the plan was.

        Takes a `Request`, or a question, chunks and `stream`'s keyword arguments. Chunks given as text are
        encoded only when the plan or its picker reads their KV (full prefill needs their ids alone); that
        encoding is timed in `encode_s`. `phases`, when given, records where the time went (plan,
        re-positioning, cache assembly and mask, forward). `probe`: the class that measures for pickers and
        strategies (a subclass may keep what it measured). `room`: tokens to be decoded after the prompt,
        counted in the context check and kept free in the cache.
        """
        request = self.request(request, chunks, **options) if isinstance(request, str) else self.with_default(request)
        return pipeline.prefill(
            self,
            request,
            self.source.chunks(request.chunks),
            self.executor,
            room=room,
            logits_to_keep=logits_to_keep,
            phases=phases,
            probe=probe,
        )

    def stream(
        self,
        question: str,
        chunks: Sequence[str | ChunkKV],
        *,
        started_at: float | None = None,
        phases: Phases | None = None,
        **options: Any,
    ) -> Iterator[str | Answer]:
        """Yield the answer's text pieces as they are decoded, then the final `Answer`.

        Args:
            question: the user's question.
            chunks: chunk texts (encoded here, counted in ttft) or ChunkKV from `encode`.
            started_at: `time.perf_counter()` when the caller's request began; ttft_s counts from there.
            phases: records where the time to first token went (see `kvrag.timing`); opt-in.
            options: the rest of the request (`kvrag.plan.request.Request`):
                strategy: a registered strategy name (`kvrag.STRATEGIES`), e.g. "target_recompute",
                    "target_only", "full_prefill", "reuse", "reorder", "token_select", or your own. None: the
                    default kvrag ships for this model (`kvrag.plan.defaults`: target_only on the named models,
                    else target_recompute; a stream answers whole, `answer` splits as the default says).
                picker: how a target strategy picks its target: "retriever" (best score; with no scores,
                    chunk 0 of a list ranked best-first), "attention", "likelihood", "lexical", "fused" or
                    "oracle" (the given `target`). Default: the oracle when `target` is given, else the
                    retriever.
                target: index of the chunk that holds the answer, when known (reported beside the pick).
                scores: one retrieval score a chunk.
                budget: fraction of context tokens a budgeted strategy may recompute (None: the default's,
                    0.05).
                strict: never exceed the budget (a long target is recomputed in part; see kvrag.plan.strategies).
                max_new_tokens, temperature, top_p, seed, stop, prompt_lookup: decoding (temperature 0 is greedy).
        """
        t0 = started_at if started_at is not None else time.perf_counter()
        request = self.request(question, chunks, **options)
        yield from pipeline.stream(
            self, request, self.source.chunks(request.chunks), self.executor, started_at=t0, phases=phases
        )

    def stream_prompt(self, prompt: str | Sequence[int], **sampling: Any) -> Iterator[str | Answer]:
        """Plain generation from a whole prompt (text, tokenized as is, or ids): full prefill, no chunks.

        The keyword arguments are `stream`'s decoding ones (max_new_tokens, temperature, top_p, seed, stop,
        prompt_lookup).
        """
        return pipeline.stream_prompt(self, self.executor, prompt, **sampling)

    def answer(
        self,
        question: str,
        chunks: Sequence[str | ChunkKV],
        *,
        parts: str | Sequence[str] | None = None,
        **kwargs: Any,
    ) -> Answer:
        """Generate the whole answer; the arguments are those of `stream`.

        Args:
            parts: answer a part at a time over the same chunks (`kvrag.plan.parts`): a list of part questions (one
                holding "{answer}" is a hop: it takes the previous part's answer), or "auto" for the built-in
                splitter (a question it cannot split is answered whole), or "model": the model lists the parts
                (`kvrag.run.parts.model_parts`; off by default, only as good as the model). Each part is its own
                request over
                the chunks' KV read once; the Answer's text holds the parts' answers a line each and `parts`
                each part's Answer. With no scores and no picker named, each part's target is picked by the
                model's likelihood of that part (`picker="likelihood"`). None with no strategy named: as the
                model's shipped default says (`kvrag.plan.defaults`: "auto" on Qwen2.5-Coder-0.5B).
        """
        if parts is None and kwargs.get("strategy") in (None, "default"):  # the shipped default may split questions
            parts = default_parts(shipped_default(self.fingerprint.weights))
        if parts is None:
            return last_answer(self.stream(question, chunks, **kwargs))
        t0 = time.perf_counter()
        split_parts = resolve_parts(question, parts, lambda q: run_parts.model_parts(self, q, self.stream_prompt))
        if split_parts is None:
            return last_answer(self.stream(question, chunks, started_at=t0, **kwargs))
        request = Request.of(question, chunks, **kwargs)
        named = request.picker  # the caller's, before the default: without it each part's likelihood picks
        self.with_default(request)
        return run_parts.answer_parts(
            self,
            request,
            split_parts,
            self.source.chunks(request.chunks),
            self.executor,
            started_at=t0,
            named_picker=named,
        )
