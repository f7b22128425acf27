"""KVModel: a causal LM that encodes chunks once and answers over their stored KV.

This is the public surface the retrieval engine, the strategies and the adapters build on: encode chunk
texts to chunk KV, and answer a question over a caller-given list of chunks (texts or their KV) with any
registered strategy. It owns one model, its prompt layout, its prefix KV, its lock and its in-process
executor; an answer itself goes through `kvrag.run.pipeline` (plan, execute, decode). It never retrieves.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from kvrag import cpu
from kvrag.answer import Answer, AnswerStats, last_answer
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.kv import ChunkKey, ChunkKV, chunk_key, encoder_id
from kvrag.errors import ContextOverflowError, EmptyInputError, InvalidRequestError, UnsupportedModelError
from kvrag.model.catalog import named
from kvrag.model.encode import DEFAULT_BATCH_TOKENS, encode_chunks, encode_prefix
from kvrag.model.layout import PromptLayout
from kvrag.model.loading import (
    check_architecture,
    fingerprint,
    load_pretrained,
    resolve_dtype,
)
from kvrag.model.loading import (
    weights_id as default_weights_id,
)
from kvrag.model.rope import Repositioner
from kvrag.plan.defaults import default_parts, shipped_default
from kvrag.plan.parts import resolve_parts
from kvrag.plan.probe import Probe
from kvrag.plan.request import Request
from kvrag.run import parts as run_parts
from kvrag.run import pipeline
from kvrag.run.executor import HFExecutor
from kvrag.run.generate import Sampling
from kvrag.run.pipeline import Prefilled
from kvrag.run.recompute import full_prefill
from kvrag.timing import Phases

# A neutral text for `KVModel(lead=...)`: what a chunk is encoded behind so that its first tokens do not act as
# the opening of the context (an attention sink) once it is stitched behind other chunks.
DEFAULT_LEAD = "The passages below come from several documents, one after another, each on its own topic."

_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()
# Attention implementations that honour a custom 4-D additive mask (flash attention reads it as padding).
MASK_ATTENTION = ("sdpa", cpu.GQA_SDPA, "eager", "flex_attention")


def model_lock(model: Any) -> threading.RLock:
    """The one lock of a model object, shared by every KVModel and engine built on it."""
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


class KVModel:
    """A causal LM wrapper that reuses per-chunk KV.

    Args:
        model: a Hugging Face causal LM of a supported architecture (`kvrag.model.loading.SUPPORTED_MODEL_TYPES`).
        tokenizer: its tokenizer.
        weights_id: what identifies the weights in the fingerprint; by default found from where the model was
            loaded (see `kvrag.model.loading.weights_id`).
        layout: how prompts are split; by default the tokenizer's chat template.
        batch_tokens: rows x padded length per encoding forward.
        lead: text every chunk is encoded behind, after the prefix, and that never enters a prompt: a chunk's
            KV then never believes it opens the context (see `DEFAULT_LEAD`). "" (the default) encodes each
            chunk right behind the prefix. A chunk's KV, and its store key, depend on the lead.
        compile_decode: decode through torch.compile'd layer steps (`kvrag.cpu.decode`): seconds of compiling at
            the first decoded token, then faster tokens; worth it in a process that answers many questions.
        decode_weights: what the C decode step reads: "model" (the default: the model's own weights, the tokens
            of transformers' forward), or "int8" or "int4" copies of the weights (`kvrag.cpu.decode_weights`:
            about half and a quarter of bfloat16's bytes a token, quantized once at load; the tokens may differ
            from the model's own, docs/performance.md says how often). The prompt's prefill is unchanged. Where
            the C step does not take the model it decodes over the model's own weights and warns.
        cpu_kernels: let kvrag's CPU engine (`kvrag.cpu`: C kernels and module swaps, the same tokens) take this
            model's work where it applies; False keeps the model as transformers made it (set once, per model).

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
        decode_weights: str = "model",
        cpu_kernels: bool = True,
    ) -> None:
        check_architecture(model.config)
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in MASK_ATTENTION:
            raise UnsupportedModelError(
                f"attention implementation '{attention}' does not take the 4-D position mask that stitching needs: "
                f"load the model with attn_implementation= one of {', '.join(MASK_ATTENTION)}"
            )
        cpu.install(model, enabled=cpu_kernels)  # the CPU engine's prefill modules (`kvrag.cpu`), or none
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
        self.loaded_from: str | None = None  # what `from_pretrained` loaded it from (an index's manifest records it)
        self.lock = model_lock(model)  # one forward at a time on the one model, never held across a yield
        self.executor = HFExecutor(self)  # runs plans in-process (its stitched-cache buffers serve one answer a time)
        self.source = ChunkSource(self)  # chunk KV for requests that give texts: encoded, no store
        if compile_decode:
            cpu.compile_decoding(model)  # compiled at the first decoded token (`kvrag.cpu`)
        if decode_weights != "model" and not cpu.decode_weights(model, decode_weights):  # quantized now, once
            warnings.warn(f"decode_weights={decode_weights!r} is not taken for this model here (the C decode step "
                          "does not take it: see kvrag.cpu.decode_weights); it decodes over its own weights",
                          RuntimeWarning, stacklevel=2)

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
        """Load a named model (`kvrag models`: "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"), a
        Hugging Face id or a folder; None loads the embedded default (SmolLM2-135M-Instruct).

        A named model is converted once from the GGUF in its registry packages to safetensors under `cache_dir`
        (default: the user's cache directory, kvrag/); `dtype="auto"` then loads it in the dtype it was converted to
        (bfloat16 for the Qwen models: float32 would double the memory for the same values). Nothing is downloaded.
        """
        cache = Path(cache_dir) if cache_dir is not None else None
        if dtype in (None, "auto") and not Path(str(name_or_path)).exists() and (entry := named(name_or_path)):
            dtype = entry.dtype
        model, tokenizer, weights = load_pretrained(
            name_or_path,
            dtype=resolve_dtype(dtype, device),
            device=device,
            cache_dir=cache,
            attn_implementation=attn_implementation,
        )
        kv = cls(model, tokenizer, weights_id=weights, **kwargs)
        kv.loaded_from = str(name_or_path) if name_or_path is not None else None
        return kv

    def with_lead(self, lead: str = "") -> KVModel:
        """The same model, tokenizer and layout, with chunks encoded behind `lead` (see the class's Args)."""
        if lead == self.lead:
            return self
        other = KVModel(
            self.model,
            self.tokenizer,
            weights_id=self.fingerprint.weights,
            layout=self.layout,
            batch_tokens=self.batch_tokens,
            lead=lead,
            cpu_kernels=cpu.enabled(self.model),
        )
        other.loaded_from = self.loaded_from
        return other

    # -- encoding ---------------------------------------------------------------------------------------

    def encode(self, texts: Sequence[str]) -> list[ChunkKV]:
        """Encode chunk texts behind the prefix at the canonical start; one ChunkKV per text."""
        ids = [self.chunk_ids(i, t) for i, t in enumerate(texts)]
        with self.lock:
            return encode_chunks(
                self.model, self.chunk_prefix, ids, batch_tokens=self.batch_tokens, encoder=self.encoder_id
            )

    def chunk_key(self, chunk: ChunkKV | Sequence[int], *, namespace: str = "", secret: bytes = b"") -> ChunkKey:
        """The store key of a chunk under this model, dtype, chunk prefix, `namespace` and `secret` (the one key
        function)."""
        ids = chunk.token_ids.tolist() if isinstance(chunk, ChunkKV) else list(chunk)
        return chunk_key(self.fingerprint.digest, self.chunk_prefix_ids, ids, salt=namespace, secret=secret)

    # -- answering --------------------------------------------------------------------------------------

    def prompt_ids(self, question: str, chunk_ids: Sequence[Sequence[int]], order: Sequence[int]) -> list[int]:
        """The stitched prompt's ids: prefix, chunks in `order`, suffix."""
        ids = list(self.layout.prefix_ids)
        for c in order:
            ids.extend(chunk_ids[c])
        return ids + self.layout.suffix_ids(question)

    def request(self, question: str, chunks: Sequence[str | ChunkKV], **options: Any) -> Request:
        """The `Request` that `stream`'s keyword arguments describe (validated here, once)."""
        return Request.of(question, chunks, **options)

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
        if isinstance(request, str):
            request = self.request(request, chunks, **options)
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
        t0 = time.perf_counter()
        decoding = Sampling(**sampling)
        ids = (
            list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if isinstance(prompt, str)
            else list(prompt)
        )
        if not ids:
            raise EmptyInputError("the prompt is empty: give it text")
        if len(ids) + decoding.max_new_tokens > self.max_positions:
            raise ContextOverflowError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is {decoding.max_new_tokens}: "
                f"{len(ids) + decoding.max_new_tokens} > the model's {self.max_positions}-token context"
            )
        with self.lock:
            out = full_prefill(self.model, ids)
        out.prompt_ids = ids

        def stats(tokens: list[int], ttft: float, total: float) -> AnswerStats:
            return AnswerStats.of_prompt(len(ids), len(tokens), ttft, total)

        yield from pipeline.decode_answer(self, self.executor, out, decoding, t0, stats)

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
        split_parts = resolve_parts(question, parts, lambda q: run_parts.model_parts(self, q))
        if split_parts is None:
            return last_answer(self.stream(question, chunks, started_at=t0, **kwargs))
        request = self.request(question, chunks, **kwargs)
        return run_parts.answer_parts(
            self, request, split_parts, self.source.chunks(request.chunks), self.executor, started_at=t0
        )

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
