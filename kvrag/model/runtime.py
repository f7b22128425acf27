"""The model runtime: one causal LM made ready to encode chunks and to be stitched over.

It owns the model and its tokenizer, the prompt layout, the prefix KV (and the chunk prefix a lead adds), the
encoding set-up, the chunk key and the encoder id, the prompt's token ids, the checks a chunk passes, the eos ids,
and, through the CPU engine's state for the model object (`kvrag.cpu.ModelState`, shared by every runtime on that
object), the model's lock and decode settings. cache/, plan/ and run/ build on it; it never plans, retrieves or
answers (`kvrag.kvmodel.KVModel`, the facade, does that over it).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch

from kvrag import cpu
from kvrag.cache.kv import ChunkKey, ChunkKV, chunk_key, encoder_id
from kvrag.errors import ContextOverflowError, InvalidRequestError, UnsupportedModelError
from kvrag.model.catalog import named, shipped_decode_weights, shipped_header
from kvrag.model.encode import DEFAULT_BATCH_TOKENS, context_runs, encode_prefix, encode_runs
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

# A neutral text for `KVModel(lead=...)`: what a chunk is encoded behind so that its first tokens do not act as
# the opening of the context (an attention sink) once it is stitched behind other chunks.
DEFAULT_LEAD = "The passages below come from several documents, one after another, each on its own topic."

# Attention implementations that honour a custom 4-D additive mask (flash attention reads it as padding).
MASK_ATTENTION = ("sdpa", cpu.GQA_SDPA, "eager", "flex_attention")
Runtime = TypeVar("Runtime", bound="ModelRuntime")  # a ModelRuntime's own class (a KVModel's is KVModel)


def model_lock(model: Any) -> threading.RLock:
    """The one lock of a model object, shared by every KVModel and engine built on it (its `kvrag.cpu.ModelState`'s)."""
    return cpu.state_of(model).lock


class ModelRuntime:
    """A causal LM made ready for chunk KV: what every layer above reads of the model (`KVModel` is one).

    Args:
        model: a Hugging Face causal LM of a supported architecture (`kvrag.model.loading.SUPPORTED_MODEL_TYPES`).
        tokenizer: its tokenizer.
        weights_id: what identifies the weights in the fingerprint; by default found from where the model was
            loaded (see `kvrag.model.loading.weights_id`).
        layout: how prompts are split; by default the tokenizer's chat template, with the named model's shipped
            context header (`kvrag.model.catalog.shipped_header`: the 1.5B's asks the model to say the documents do
            not say; kvrag's own for any other model).
        batch_tokens: rows x padded length per encoding forward.
        lead: text every chunk is encoded behind, after the prefix, and that never enters a prompt: a chunk's
            KV then never believes it opens the context (see `DEFAULT_LEAD`). "" (the default) encodes each
            chunk right behind the prefix. A chunk's KV, and its store key, depend on the lead.
        compile_decode: decode through torch.compile'd layer steps (`kvrag.cpu.decode`): seconds of compiling at
            the first decoded token, then faster tokens; worth it in a process that answers many questions.
        decode_weights: what the C decode step reads: "model" (the model's own weights, the tokens of
            transformers' forward), or "int8" or "int4" copies of the weights (`kvrag.cpu.decode_weights`: about
            half and a quarter of bfloat16's bytes a token, quantized once at load; the tokens may differ from the
            model's own, docs/performance.md says how often). None (the default): the named model's shipped choice
            (`kvrag.model.catalog.shipped_decode_weights`, docs/models.md), "model" for any other model. The
            prompt's prefill is unchanged. Where the C step does not take the model it decodes over the model's own
            weights (and warns where the choice was the caller's).
        cpu_kernels: let kvrag's CPU engine (`kvrag.cpu`: C kernels and module swaps, the same tokens) take this
            model's work where it applies; False keeps the model as transformers made it.

    `compile_decode`, `decode_weights` and `cpu_kernels` belong to the model object, not to one runtime: the first
    runtime on a model sets them, and every later one on the same object shares them (and its lock). A later one
    asking for other values raises InvalidRequestError naming them, rather than changing the first one's decoding
    under it; give it its own copy of the model (`copy.deepcopy(model)`, or load it again) instead.

    Example:
        >>> runtime = ModelRuntime.from_pretrained()            # the embedded default, offline
        >>> chunks = runtime.encode(["Paris is the capital of France.", "Rome is in Italy."])
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
        check_architecture(model.config)
        attention = getattr(model.config, "_attn_implementation", "sdpa")
        if attention not in MASK_ATTENTION:
            raise UnsupportedModelError(
                f"attention implementation '{attention}' does not take the 4-D position mask that stitching needs: "
                f"load the model with attn_implementation= one of {', '.join(MASK_ATTENTION)}"
            )
        weights = weights_id or default_weights_id(model)
        asked, decode_weights = decode_weights, decode_weights or shipped_decode_weights(weights)
        # the CPU engine's state for this model object: its prefill modules installed (or none) by the first runtime
        self.cpu_state = cpu.attach(
            model, cpu_kernels=cpu_kernels, compile_decode=compile_decode, decode_weights=decode_weights
        )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.layout = layout or PromptLayout(tokenizer, header=shipped_header(weights))
        self.repositioner = Repositioner(model)
        self.fingerprint = fingerprint(model, weights)
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
        self.lock = self.cpu_state.lock  # one forward at a time on the one model, never held across a yield
        taken = decode_weights == "model" or cpu.decode_weights(model, decode_weights)  # quantized now, once
        if not taken and asked is not None:  # a shipped choice the machine cannot take decodes over the model's own
            warnings.warn(f"decode_weights={decode_weights!r} is not taken for this model here (the C decode step "
                          "does not take it: see kvrag.cpu.decode_weights); it decodes over its own weights",
                          RuntimeWarning, stacklevel=2 if type(self) is ModelRuntime else 3)

    @classmethod
    def from_pretrained(
        cls: type[Runtime],
        name_or_path: str | Path | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str = "cpu",
        cache_dir: str | Path | None = None,
        attn_implementation: str | None = None,
        **kwargs: Any,
    ) -> Runtime:
        """Load a named model (`kvrag models`: "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"), a
        Hugging Face id or a folder; None loads the embedded default (SmolLM2-135M-Instruct).

        A named model is converted once from the GGUF in its registry packages to safetensors under `cache_dir`
        (default: the user's cache directory, kvrag/); `dtype="auto"` then loads it in the dtype it was converted to
        (bfloat16 for the Qwen models: float32 would double the memory for the same values), but on a CPU that does
        not multiply bfloat16 in hardware (`kvrag.cpu.native_bfloat16`: AVX2 alone) in float32, which computes the
        same weights several times faster there. Nothing is downloaded.

        `header=` (text) stands for `layout=PromptLayout(tokenizer, header=...)`, the tokenizer being the one loaded
        here: e.g. `kvrag.model.layout.DECLINING_HEADER`. Chunks encoded under one header are another header's misses.
        """
        cache = Path(cache_dir) if cache_dir is not None else None
        if dtype in (None, "auto") and not Path(str(name_or_path)).exists() and (entry := named(name_or_path)):
            dtype = entry.dtype
            if dtype == torch.bfloat16 and str(device) == "cpu" and not cpu.native_bfloat16():
                dtype = torch.float32  # the same values, computed several times faster on such a CPU
        model, tokenizer, weights = load_pretrained(
            name_or_path,
            dtype=resolve_dtype(dtype, device),
            device=device,
            cache_dir=cache,
            attn_implementation=attn_implementation,
        )
        if "header" in kwargs:
            if kwargs.get("layout") is not None:
                raise InvalidRequestError("give header= or layout=, not both: the layout holds its header")
            kwargs["layout"] = PromptLayout(tokenizer, header=kwargs.pop("header"))
        kv = cls(model, tokenizer, weights_id=weights, **kwargs)
        kv.loaded_from = str(name_or_path) if name_or_path is not None else None
        return kv

    def with_lead(self: Runtime, lead: str = "") -> Runtime:
        """The same model, tokenizer and layout, with chunks encoded behind `lead` (see the class's Args)."""
        return self if lead == self.lead else self._like(self.layout, lead)

    def with_header(self: Runtime, header: str) -> Runtime:
        """The same model and tokenizer, the layout's context header `header` (the rest of the layout kept): what an
        index whose chunks were encoded under that header answers with."""
        if header == self.layout.header:
            return self
        layout = self.layout
        return self._like(
            PromptLayout(
                self.tokenizer,
                system_prompt=layout.system_prompt,
                header=header,
                question_template=layout.question_template,
                use_chat_template=layout.use_chat_template,
            ),
            self.lead,
        )

    def _like(self: Runtime, layout: PromptLayout, lead: str) -> Runtime:
        """Another runtime on this one's model object (its settings and lock shared) with `layout` and `lead`."""
        other = type(self)(
            self.model,
            self.tokenizer,
            weights_id=self.fingerprint.weights,
            layout=layout,
            batch_tokens=self.batch_tokens,
            lead=lead,
            **self.cpu_state.settings(),
        )
        other.loaded_from = self.loaded_from
        return other

    # -- encoding ---------------------------------------------------------------------------------------

    def encode(self, texts: Sequence[str]) -> list[ChunkKV]:
        """Encode chunk texts behind the prefix at the canonical start; one ChunkKV per text."""
        ids = [self.chunk_ids(i, t) for i, t in enumerate(texts)]
        with self.lock:
            return self.encode_ids(ids)

    def encode_ids(
        self, ids: Sequence[Sequence[int]], *, on_batch: Callable[[int], None] | None = None
    ) -> list[ChunkKV]:
        """Encode chunks given as token ids behind the chunk prefix (the one encoding set-up); the caller holds
        `lock`. `on_batch(n)` after each forward of n chunks."""
        return [run[0] for run in self.encode_runs_ids([[chunk] for chunk in ids], on_batch=on_batch)]

    def encode_in_context(self, documents: Sequence[Sequence[str]]) -> list[list[ChunkKV]]:
        """Each document's chunks (texts, in document order) encoded in its context: a chunk behind the document's
        earlier chunks, in runs of at most `context_window` tokens (`kvrag.model.encode.encode_runs`); one ChunkKV a
        chunk, each at the position it holds in its run. A document's chunks stitched in order are then exactly its
        full prefill, where a run holds them all."""
        ids = [[self.chunk_ids(i, t) for i, t in enumerate(doc)] for doc in documents]
        runs = [[[doc[i] for i in run] for run in self.context_runs(doc)] for doc in ids]
        with self.lock:
            encoded = self.encode_runs_ids([run for doc in runs for run in doc])
        out, n = [], 0
        for doc in runs:
            out.append([kv for run in encoded[n : n + len(doc)] for kv in run])
            n += len(doc)
        return out

    @property
    def context_window(self) -> int:
        """The most tokens of a document a run encodes in one context: an encoding forward's width, within the
        model's positions."""
        return max(1, min(self.batch_tokens, self.max_positions - len(self.chunk_prefix)))

    def context_runs(self, chunk_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """One document's chunks (ids, in order) as runs of consecutive chunk indices, each within `context_window`."""
        return context_runs([len(ids) for ids in chunk_ids], self.context_window)

    def encode_runs_ids(
        self, runs: Sequence[Sequence[Sequence[int]]], *, on_batch: Callable[[int], None] | None = None
    ) -> list[list[ChunkKV]]:
        """Encode runs of chunks (ids) each in its run's context behind the chunk prefix; the caller holds `lock`."""
        return encode_runs(
            self.model,
            self.chunk_prefix,
            runs,
            batch_tokens=self.batch_tokens,
            on_batch=on_batch,
            encoder=self.encoder_id,
        )

    def chunk_key(
        self,
        chunk: ChunkKV | Sequence[int],
        *,
        namespace: str = "",
        secret: bytes = b"",
        context: Sequence[int] = (),
    ) -> ChunkKey:
        """The store key of a chunk under this model, dtype, chunk prefix, `namespace` and `secret` (the one key
        function); `context`: the ids it was encoded behind in its run (none: encoded alone)."""
        ids = chunk.token_ids.tolist() if isinstance(chunk, ChunkKV) else list(chunk)
        return chunk_key(
            self.fingerprint.digest, self.chunk_prefix_ids, ids, salt=namespace, secret=secret, context=context
        )

    # -- prompts ----------------------------------------------------------------------------------------

    def prompt_ids(self, question: str, chunk_ids: Sequence[Sequence[int]], order: Sequence[int]) -> list[int]:
        """The stitched prompt's ids: prefix, chunks in `order`, suffix."""
        return self.prompt_of([chunk_ids[c] for c in order], self.layout.suffix_ids(question))

    def prompt_of(self, chunk_ids: Sequence[Sequence[int]], suffix_ids: Sequence[int]) -> list[int]:
        """The prompt's ids from its chunks' ids, first to last, and its suffix ids: the one place a prompt is
        assembled (prefix, chunks, suffix)."""
        return [*self.layout.prefix_ids, *(t for ids in chunk_ids for t in ids), *suffix_ids]

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
