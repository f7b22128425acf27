"""Many prompts' caches as one left-padded batch: decode, teacher-force or score them in one forward a step.

Each row keeps its own logical positions (its prompt length onwards); the padding is zeros that a 2-D mask
hides. The study decodes its references and strategy rows this way, and the likelihood picker scores the
question behind every chunk in one pass. This module never plans or stitches.
"""

from __future__ import annotations

import contextlib
from typing import Any, Collection, Sequence

import torch

from kvrag.cache.kv import ChunkKV
from kvrag.compat import with_cache
from kvrag.model.recompute import Prefill, StitchedCache
from kvrag.model.rope import Repositioner


def crop(cache: Any, n: int) -> None:
    """Drop every cached token after the first n (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


class PaddedBatch:
    """Rows of KV of any lengths as one batch cache: each row right-aligned (left padding) behind a mask, with
    `room` free slots after it.

    Args:
        model: the causal LM the KV came from.
        rows: per row, per layer, (keys, values) [H_kv, T_row, D] of positions 0..T_row-1 in order.
        room: slots kept after the widest row for appended tokens.
        last_logits: [B, V] logits of each row's last position (what the first appended token is picked from).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        rows: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        room: int,
        last_logits: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        lengths = [row[0][0].shape[-2] for row in rows]
        self.size, self.width = len(rows), max(lengths)
        k0, v0 = rows[0][0]
        self.device = k0.device
        shape = (len(rows[0]), self.size, k0.shape[0], self.width + room)  # [L, B, H_kv, capacity]
        keys, values = k0.new_empty((*shape, k0.shape[-1])), v0.new_empty((*shape, v0.shape[-1]))
        for b, (row, n) in enumerate(zip(rows, lengths)):
            pad = self.width - n
            keys[:, b, :, :pad] = 0
            values[:, b, :, :pad] = 0
            for i, (k, v) in enumerate(row):
                if k.shape[-2] != n:
                    raise ValueError(f"row {b} holds {k.shape[-2]} tokens in layer {i}, not its {n}")
                keys[i, b, :, pad : self.width] = k
                values[i, b, :, pad : self.width] = v
        self.cache = StitchedCache(keys, values, self.width)
        self.positions = torch.tensor(lengths, device=self.device)
        self.mask = None
        if min(lengths) < self.width:
            slots = torch.arange(self.width, device=self.device)
            self.mask = (slots >= (self.width - self.positions)[:, None]).long()
        self.last_logits = last_logits

    @classmethod
    def of_prefills(cls, model: torch.nn.Module, prefills: Sequence[Prefill], room: int) -> PaddedBatch:
        """Prefills whose caches hold their prompt in logical order (a full prefill), one row each."""
        rows = []
        for prefill in prefills:
            layers = prefill.cache.layers
            if layers[0].keys.shape[-2] != prefill.next_position:
                raise ValueError(
                    f"a prefill's cache holds {layers[0].keys.shape[-2]} tokens, not its {prefill.next_position}"
                )
            rows.append([(layer.keys[0], layer.values[0]) for layer in layers])
        return cls(model, rows, room, torch.stack([p.logits[-1] for p in prefills]).float())

    @classmethod
    def of_chunks(
        cls,
        model: torch.nn.Module,
        prefix: ChunkKV,
        chunks: Sequence[ChunkKV],
        room: int,
        repositioner: Repositioner | None = None,
    ) -> PaddedBatch:
        """One row a chunk: the prefix, then the chunk's stored KV at its canonical start. A chunk encoded elsewhere
        (in its document's context) is moved there by `repositioner`; without one it is refused."""
        rows = []
        for chunk in chunks:
            keys = chunk.keys
            if chunk.start != len(prefix):
                if repositioner is None:
                    raise ValueError(f"a chunk encoded at {chunk.start} does not follow the {len(prefix)}-token prefix")
                deltas = torch.full((len(chunk),), len(prefix) - chunk.start, dtype=torch.long)
                keys = repositioner.shift(chunk.keys, deltas)
            rows.append(
                [
                    (torch.cat((prefix.keys[i], keys[i]), 1), torch.cat((prefix.values[i], chunk.values[i]), 1))
                    for i in range(prefix.keys.shape[0])
                ]
            )
        return cls(model, rows, room)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, step: int) -> torch.Tensor:
        """[B, T, V] logits of `ids` [B, T], which follow `step` tokens already appended after every row."""
        t = ids.shape[1]
        positions = self.positions[:, None] + step + torch.arange(t, device=self.device)
        mask = None
        if self.mask is not None:
            mask = torch.cat([self.mask, self.mask.new_ones((self.size, step + t))], dim=1)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            **with_cache(self.model, self.cache),
            use_cache=True,
        )
        return out.logits.float()

    def subset(self, rows: Sequence[int], step: int) -> PaddedBatch:
        """A batch of these rows only (a copy), with the `step` tokens appended to each so far."""
        index = torch.tensor(rows, device=self.device)
        new = object.__new__(PaddedBatch)
        new.model, new.device, new.size, new.width = self.model, self.device, len(rows), self.width
        layers, n = self.cache.layers, self.width + step
        buffers = []
        for name in ("_keys", "_values"):
            first = getattr(layers[0], name)  # [B, H_kv, capacity, D]: the new batch keeps the same room
            buffer = first.new_empty((len(layers), len(rows), *first.shape[1:]))
            for i, layer in enumerate(layers):
                torch.index_select(getattr(layer, name)[:, :, :n], 0, index, out=buffer[i, :, :, :n])
            buffers.append(buffer)
        new.cache = StitchedCache(*buffers, n)
        new.positions = self.positions[index]
        new.last_logits = None if self.last_logits is None else self.last_logits[index]
        new.mask = None if self.mask is None else self.mask[index]
        if new.mask is not None and bool(new.mask.all()):
            new.mask = None  # no row left is padded
        return new

    def row(self, b: int, step: int, room: int) -> tuple[StitchedCache, int]:
        """Row `b` with the `step` tokens appended after it, as a cache of its own (its padding dropped, its
        tokens in logical order from slot 0) with `room` free slots after them, and its length."""
        n = int(self.positions[b]) + step
        pad = self.width - int(self.positions[b])
        first = self.cache.layers[0]
        keys = first._keys.new_empty((len(self.cache.layers), 1, first._keys.shape[1], n + room, first._keys.shape[3]))
        values = first._values.new_empty((*keys.shape[:-1], first._values.shape[3]))
        for i, layer in enumerate(self.cache.layers):
            keys[i, 0, :, :n] = layer._keys[b, :, pad : self.width + step]
            values[i, 0, :, :n] = layer._values[b, :, pad : self.width + step]
        return StitchedCache(keys, values, n), n

    def reset(self) -> None:
        """Drop every token appended after the rows."""
        crop(self.cache, self.width)

    def greedy(self, max_new_tokens: int, stop_ids: Collection[int], lock: Any = None) -> list[list[int]]:
        """Each row's greedy tokens up to and including its first stop id, at most `max_new_tokens`.

        The streaming decoder (`kvrag.run.generate.decode`) serves one answer with sampling and stop strings;
        this loop serves many greedy rows at once (the study's references and strategies), dropping the
        rows that finished. The batch is reset afterwards.
        """
        logits = self.last_logits
        tokens: list[list[int]] = [[] for _ in range(self.size)]
        done = [False] * self.size
        active, live = self, list(range(self.size))  # the rows still decoding, and the row of each in `self`
        for step in range(max_new_tokens):
            picks = logits.argmax(-1)
            for b, token in zip(live, picks.tolist()):
                if not done[b]:
                    tokens[b].append(token)
                    done[b] = token in stop_ids
            if all(done) or step + 1 == max_new_tokens:
                break
            going = [i for i, b in enumerate(live) if not done[b]]
            # A step reads every row's KV: once the finished rows would cost more over the steps left than
            # copying the others out (about two steps' reading of each), go on with a copy of the rest.
            if (len(live) - len(going)) * (max_new_tokens - step - 1) > 2 * len(going):
                active, live, picks = active.subset(going, step), [live[i] for i in going], picks[going]
            with lock or contextlib.nullcontext():
                logits = active.forward(picks.view(-1, 1), step)[:, -1]
        self.reset()
        return tokens

    def teacher_forced(self, sequences: Sequence[list[int]], lock: Any = None) -> list[torch.Tensor]:
        """Teacher forcing, all rows in one forward: per row, [1 + len(sequence), V] logits (the prefill's last
        row, then one row per forced token). The batch is reset afterwards."""
        width = max(map(len, sequences))
        rows = [self.last_logits[b : b + 1] for b in range(self.size)]
        if not width:
            return rows
        padded = [s + [s[-1] if s else 0] * (width - len(s)) for s in sequences]  # after each row's end: unread
        with lock or contextlib.nullcontext():
            logits = self.forward(torch.tensor(padded, device=self.device), 0)
        self.reset()
        return [torch.cat([rows[b], logits[b, : len(s)]]) for b, s in enumerate(sequences)]
