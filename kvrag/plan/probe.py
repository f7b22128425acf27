"""Measurements a plan or a picker may ask of the model, each costed in token-layers.

A probe belongs to one request: the prefix, the chunks' KV and the suffix. It answers four questions:
how far each context token's reused KV is from fresh KV at a check layer (token_select), how much of the
question's attention each chunk receives over the reused cache (the attention picker), how likely the
question is behind each chunk alone (the likelihood picker), and what a chunk's KV is in a full prefill of
a given order (the insert_full_kv oracle). It never decides anything. Each measurement reads the chunk KV it
needs from the store, then takes the model's lock itself, so a plan that measures nothing (the retriever's
pick) is made without waiting for the model, and no store read ever holds the lock.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence, TypeVar

import torch
from transformers import DynamicCache

from kvrag.cache.chunks import Chunks
from kvrag.cache.kv import ChunkKV
from kvrag.compat import with_cache
from kvrag.model.batch import PaddedBatch
from kvrag.model.encode import stacked_kv
from kvrag.model.recompute import Prefill, as_cache, full_prefill, recompute
from kvrag.model.rope import Repositioner
from kvrag.model.runtime import ModelRuntime


Measured = TypeVar("Measured", bound=Callable[..., Any])


def _measurement(reads: Callable[..., Sequence[int]] | None = None) -> Callable[[Measured], Measured]:
    """A measurement: the chunk KV it `reads` (given its arguments; None: every chunk) is read from the store
    first, outside the model's lock, so a slow store holds up this request only; then it runs under the lock
    (re-entrant: a caller may already hold it), without autograd."""

    def wrap(method: Measured) -> Measured:
        @functools.wraps(method)
        def measured(self: Probe, *args: Any, **kwargs: Any) -> Any:
            if isinstance(self._chunks, Chunks):
                self._chunks.prefetch(reads(self, *args, **kwargs) if reads is not None else None)
            with self.lock, torch.inference_mode():
                return method(self, *args, **kwargs)

        return measured  # type: ignore[return-value]

    return wrap


def _candidates(probe: Probe, candidates: Sequence[int] | None = None) -> list[int]:
    """The chunks question_likelihood scores, checked."""
    n = len(probe._chunks)
    scored = list(range(n)) if candidates is None else sorted(set(candidates))
    if any(not 0 <= c < n for c in scored):
        raise ValueError(f"candidates {list(candidates or [])} are not all chunk indices in 0..{n - 1}")
    return scored


class _CheckLayerReached(Exception):
    pass


class _StopAfterLayerCache(DynamicCache):
    """A cache that ends the forward once layer `stop_layer` has written its fresh keys and values."""

    stop_layer = 1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.stop_layer:
            raise _CheckLayerReached
        return out


class Probe:
    """Model measurements for one request, with their cost.

    Attributes:
        extra_token_layers: work spent outside the plan's own prefill, in token-layer units
            (one token through one decoder layer).
        extra_work: what that work was, one line each.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        repositioner: Repositioner,
        prefix: ChunkKV,
        chunks: Chunks | Sequence[ChunkKV],
        suffix_ids: Sequence[int],
        *,
        question: str = "",
        chunk_prefix: ChunkKV | None = None,
        lock: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        self.model = model
        self.repositioner = repositioner
        self.prefix = prefix
        # a request's Chunks (whose KV is fetched only when a measurement reads it) or plain chunk KV
        self._chunks = chunks
        self.suffix_ids = list(suffix_ids)
        self.num_layers = int(model.config.num_hidden_layers)
        self.extra_token_layers = 0
        self.extra_work: list[str] = []
        self.chunk_prefix = chunk_prefix or prefix  # what the chunks were encoded behind (the prefix and a lead)
        self.question = question  # the question's text, for pickers that read words
        self.lock = lock or contextlib.nullcontext()  # the model's lock, taken by each measurement
        # the last question-likelihood pass: per scored chunk, (batch, row, [V] logits of the suffix's last token):
        # behind the prefix, that chunk's stored KV and the whole suffix, the prefill of `target_only` over it
        self.suffix_rows: dict[int, tuple[PaddedBatch, int, torch.Tensor]] = {}
        self._likelihood: dict[tuple[int, ...], torch.Tensor] = {}  # question_likelihood's answers, by chunks scored
        self._alone: float | None = None  # question_alone's answer

    @classmethod
    def of(cls, kvmodel: ModelRuntime, chunks: Chunks, suffix_ids: Sequence[int], question: str) -> Probe:
        """The probe of one request on a model runtime (a KVModel is one)."""
        return cls(
            kvmodel.model,
            kvmodel.repositioner,
            kvmodel.prefix,
            chunks,
            suffix_ids,
            question=question,
            chunk_prefix=kvmodel.chunk_prefix,
            lock=kvmodel.lock,
        )

    @property
    def texts(self) -> list[str]:
        """The chunks' texts (pickers that read words)."""
        if isinstance(self._chunks, Chunks):
            return self._chunks.texts()
        raise ValueError("this probe was made over chunk KV alone, without a request's texts")

    @property
    def chunks(self) -> list[ChunkKV]:
        """The chunks' KV, as a measurement reads it (a miss is encoded: under the model's lock)."""
        with self.lock:
            return self._chunks.kv() if isinstance(self._chunks, Chunks) else list(self._chunks)

    def kv_of(self, indices: Sequence[int]) -> list[ChunkKV]:
        """The KV of these chunks only (a plan that reads a few of many chunks reads those): read from the store
        without the model's lock, which only a miss to encode takes."""
        if not isinstance(self._chunks, Chunks):
            return [self._chunks[c] for c in indices]
        self._chunks.prefetch(indices)
        if self._chunks.holds(indices):
            return self._chunks.kv(indices)
        with self.lock:
            return self._chunks.kv(indices)

    @_measurement()
    def value_deviation(self, order: Sequence[int], *, check_layer: int = 1) -> torch.Tensor:
        """Per context token (stitched order), the squared distance between fresh and reused values at `check_layer`.

        Fresh values come from running layers 0..check_layer-1 over every context token behind the prefix
        and stopping once layer `check_layer` has projected its keys and values; layer 0's values never
        deviate (they see no other token), so the check layer is at least 1. Cost: check_layer layers
        over all context tokens (the check layer's own projections are a fraction of a layer more).
        """
        if not 1 <= check_layer < self.num_layers:
            raise ValueError(f"check_layer must be in 1..{self.num_layers - 1}, got {check_layer}")
        P = len(self.prefix)
        device = self.prefix.keys.device
        ids = torch.cat([self.chunks[c].token_ids for c in order]).to(device)
        cache = as_cache(self.prefix.keys, self.prefix.values, _StopAfterLayerCache)
        cache.stop_layer = check_layer
        try:
            self.model(
                input_ids=ids.view(1, -1),
                position_ids=torch.arange(P, P + len(ids), device=device).view(1, -1),
                **with_cache(self.model, cache),
                use_cache=True,
                logits_to_keep=1,
            )
        except _CheckLayerReached:
            pass
        fresh = cache.layers[check_layer].values[0, :, P:].float()  # [H_kv, T_ctx, D_v]
        reused = torch.cat([self.chunks[c].values[check_layer] for c in order], dim=1).float()  # [H_kv, T_ctx, D_v]
        self.extra_token_layers += len(ids) * check_layer
        self.extra_work.append(f"check layer {check_layer}: {check_layer} layer(s) over {len(ids)} context tokens")
        return ((fresh - reused) ** 2).sum(dim=(0, 2))  # [T_ctx]

    @_measurement()
    def chunk_attention(self, order: Sequence[int]) -> torch.Tensor:
        """Attention mass the suffix's queries put on each chunk over the reused cache, indexed by chunk.

        Averaged over layers, heads and suffix tokens. Runs one reuse prefill with eager attention (the
        only implementation that returns attention weights). Cost: the suffix through every layer.
        """
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        try:
            run = recompute(
                self.model,
                self.repositioner,
                self.prefix,
                self.chunks,
                order,
                {},
                self.suffix_ids,
                output_attentions=True,
            )
        finally:
            self.model.set_attn_implementation(previous)
        assert run.attentions is not None
        mass = torch.stack([a[0].float().mean(dim=(0, 1)) for a in run.attentions]).mean(0)  # [K]
        P = len(self.prefix)
        per_chunk = torch.zeros(len(self.chunks))
        at = P
        for c in order:
            per_chunk[c] = mass[at : at + len(self.chunks[c])].sum()
            at += len(self.chunks[c])
        self.extra_token_layers += len(self.suffix_ids) * self.num_layers
        self.extra_work.append(
            f"question attention: {len(self.suffix_ids)} suffix tokens through {self.num_layers} layers"
        )
        return per_chunk

    @_measurement(reads=_candidates)
    def question_likelihood(self, candidates: Sequence[int] | None = None) -> torch.Tensor:
        """Per chunk, the mean log-probability of the suffix's tokens read behind the prefix and that chunk alone.

        Every chunk's stored KV already sits right after the prefix, so the suffix goes in as one batch (one
        row a chunk, left-padded) over those caches: nothing is re-positioned or recomputed. The suffix's
        first token is predicted by the chunk's last, which is not run again, so it is not scored. Cost: the
        suffix through every layer, once a scored chunk.

        Args:
            candidates: the chunks to score (their KV alone is read); None scores every chunk. A chunk left
                out scores -inf.
        """
        scored = _candidates(self, candidates)
        if tuple(scored) in self._likelihood:  # asked again (a picker, then a strategy): measured once
            return self._likelihood[tuple(scored)].clone()
        out = torch.full((len(self._chunks),), float("-inf"))
        if len(self.suffix_ids) < 2:
            out[scored] = 0.0  # nothing to score: every candidate is as likely
            return out
        chunks = self._chunks.kv(scored) if isinstance(self._chunks, Chunks) else [self._chunks[c] for c in scored]
        suffix = torch.tensor(self.suffix_ids, device=self.prefix.keys.device)
        batch = PaddedBatch.of_chunks(
            self.model, self.chunk_prefix, chunks, room=len(suffix), repositioner=self.repositioner
        )
        logits = batch.forward(suffix.expand(len(chunks), -1), 0)  # [C, S, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        picked = logp.gather(-1, suffix[1:].expand(len(chunks), -1).unsqueeze(-1)).squeeze(-1)  # [C, S-1]
        self.extra_token_layers += len(chunks) * len(suffix) * self.num_layers
        self.extra_work.append(
            f"question likelihood: {len(suffix)} suffix tokens behind each of {len(chunks)} chunks, "
            f"{self.num_layers} layers"
        )
        out[scored] = picked.mean(-1).cpu()
        last = logits[:, -1]
        self.suffix_rows = {c: (batch, b, last[b]) for b, c in enumerate(scored)}
        self._likelihood[tuple(scored)] = out.clone()
        return out

    @_measurement(reads=lambda self: [])
    def question_alone(self) -> float:
        """The mean log-probability of the suffix's tokens behind the prefix alone, no chunk: what the question's
        likelihood behind a chunk is measured against (a chunk that says nothing of the question barely moves it).
        Cost: the suffix through every layer, once."""
        if self._alone is not None:
            return self._alone
        if len(self.suffix_ids) < 2:
            self._alone = 0.0
            return 0.0
        p = self.chunk_prefix
        empty = ChunkKV(p.token_ids[:0], p.keys[:, :, :0], p.values[:, :, :0], start=len(p), encoder=p.encoder)
        suffix = torch.tensor(self.suffix_ids, device=p.keys.device)
        batch = PaddedBatch.of_chunks(self.model, p, [empty], room=len(suffix))
        logp = torch.log_softmax(batch.forward(suffix.view(1, -1), 0)[0, :-1], dim=-1)
        self.extra_token_layers += len(suffix) * self.num_layers
        self.extra_work.append(f"question alone: {len(suffix)} suffix tokens, {self.num_layers} layers")
        self._alone = float(logp.gather(-1, suffix[1:].unsqueeze(-1)).mean())
        return self._alone

    def suffix_pass(self, chunk: int, room: int) -> Prefill | None:
        """The prefill of the prefix, `chunk`'s stored KV and the suffix, taken from the last question-likelihood
        pass that scored it (its row's cache copied out with `room` slots; no forward), or None when none did or
        the chunks were encoded behind a lead (their pass is then not the answer's prompt)."""
        kept = self.suffix_rows.get(chunk)
        if kept is None or self.chunk_prefix is not self.prefix:
            return None
        batch, b, logits = kept
        cache, n = batch.row(b, len(self.suffix_ids), room)
        return Prefill(logits=logits.view(1, -1), cache=cache, next_position=n, recomputed_tokens=0)

    @_measurement()
    def full_prefill_kv(self, order: Sequence[int], chunk: int) -> ChunkKV:
        """`chunk`'s KV sliced from a full prefill of prefix + chunks in `order` up to and including it."""
        upto = list(order)[: list(order).index(chunk) + 1]
        device = self.prefix.keys.device
        ids = torch.cat([self.prefix.token_ids.to(device)] + [self.chunks[c].token_ids.to(device) for c in upto])
        cache = full_prefill(self.model, ids).cache
        self.full_prefill_made(ids.tolist(), cache)
        begin = len(ids) - len(self.chunks[chunk])
        keys, values = stacked_kv(cache, 0, begin, len(ids))
        self.extra_token_layers += len(ids) * self.num_layers
        self.extra_work.append(f"oracle full prefill: {len(ids)} tokens through {self.num_layers} layers")
        original = self.chunks[chunk]
        return ChunkKV(original.token_ids, keys, values, start=begin, encoder=original.encoder)

    def full_prefill_made(self, ids: list[int], cache: DynamicCache) -> None:
        """Called with every full prefill a measurement makes (a subclass may keep it); by default dropped."""
