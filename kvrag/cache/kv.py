"""The chunk KV type and its identity.

One place knows the layout of a chunk's stored attention state: per layer and per KV head (never after
repeat_kv), keys post-RoPE at the position the chunk was encoded at. Nothing here runs the model.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import NewType, Sequence

import torch

# Bump when the stored layout or its meaning changes: every older entry then becomes a miss.
KV_FORMAT_VERSION = 1

ChunkKey = NewType("ChunkKey", str)


@dataclass(slots=True)
class ChunkKV:
    """The attention state of one run of tokens (a chunk, or the prefix)."""

    token_ids: torch.Tensor  # [T] int64, the chunk's ids exactly as they enter the stitched prompt
    keys: torch.Tensor  # [L, H_kv, T, D], post-RoPE at positions start .. start+T-1
    values: torch.Tensor  # [L, H_kv, T, D_v], position-free
    start: int  # logical position of the first token when encoded (len(prefix) for a chunk)
    encoder: str = ""  # encoder_id of the model and prefix that produced it ("" when unknown)
    # `ids_digest` of the tokens it was encoded behind after the prefix: "" for a chunk encoded alone; a chunk encoded
    # in its document's context (`kvrag.model.encode.encode_runs`) names its run's earlier chunks' ids
    behind: str = ""

    def __post_init__(self) -> None:
        if self.keys.shape[:3] != self.values.shape[:3] or self.keys.shape[2] != self.token_ids.shape[0]:
            raise ValueError(
                f"inconsistent chunk KV: keys {tuple(self.keys.shape)}, values {tuple(self.values.shape)}, "
                f"{self.token_ids.shape[0]} token ids"
            )

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ChunkKV:
        """A copy on `device` with keys and values in `dtype` (token ids stay int64)."""
        return ChunkKV(
            self.token_ids.to(device) if device is not None else self.token_ids,
            self.keys.to(device=device, dtype=dtype),
            self.values.to(device=device, dtype=dtype),
            self.start,
            self.encoder,
            self.behind,
        )

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


def ids_digest(ids: Sequence[int]) -> str:
    """What `ChunkKV.behind` holds for a chunk encoded behind `ids` (after the prefix): "" for none."""
    return hashlib.sha256(_id_bytes(ids)).hexdigest()[:32] if len(ids) else ""


def encoder_id(model_digest: str, prefix_ids: Sequence[int]) -> str:
    """What a chunk's KV depends on besides its own ids: the model fingerprint and the prefix it follows."""
    h = hashlib.sha256(f"kvrag-kv/{KV_FORMAT_VERSION}".encode())
    h.update(model_digest.encode())
    h.update(_id_bytes(prefix_ids))
    return h.hexdigest()


def chunk_key(
    model_digest: str,
    prefix_ids: Sequence[int],
    chunk_ids: Sequence[int],
    *,
    salt: str = "",
    secret: bytes = b"",
    context: Sequence[int] = (),
) -> ChunkKey:
    """The store key of a chunk's KV: format version, model fingerprint, prefix ids and chunk ids, chained.

    `context`: the ids a chunk encoded in its document's context was encoded behind (its run's earlier chunks,
    `kvrag.model.encode.encode_runs`); such KV is another chunk's than the same ids encoded alone, so it has its own
    key. Empty (a chunk encoded alone) leaves the key as it always was.

    A cache made by another model, dtype, template or format version hashes differently and is a miss.
    `salt` separates namespaces (a tenant, an approximate-KV plan) that must never share entries. With a
    `secret` the key is an HMAC-SHA256 under it: whoever lacks the secret cannot compute a tenant's keys
    (knowing its namespace label and a guessed text is not enough to probe for them).
    """
    h = hmac.new(secret, digestmod=hashlib.sha256) if secret else hashlib.sha256()
    for part in (f"kvrag-kv/{KV_FORMAT_VERSION}", model_digest, salt):
        h.update(part.encode())
        h.update(b"\x00")
    for ids in (prefix_ids, chunk_ids, *((context,) if len(context) else ())):
        h.update(len(ids).to_bytes(8, "little"))
        h.update(_id_bytes(ids))
    return ChunkKey(h.hexdigest())


def _id_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as what a key hashes: 4 bytes each, little-endian, in one call (a Python loop over 8k ids
    cost several milliseconds an answer)."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else ids
    try:
        return struct.pack(f"<{len(values)}I", *values)
    except struct.error as err:
        raise ValueError(f"token ids must be integers in [0, 2**32): {err}") from None


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A reused chunk whose KV stays in the store: the executor reads it there itself (`Executor.reads_store`)."""

    key: str  # the store key of its entry
    start: int  # the position its KV was encoded at
    length: int  # its tokens

    def __len__(self) -> int:
        return self.length
