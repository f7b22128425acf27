"""The plan a kvrag request carries into vLLM: which stored entries fill the prompt's head, and where.

Both sides read it: kvrag's executor writes it into the request's `kv_transfer_params`, vLLM's scheduler
and worker (the connector) read it back. Plain data, no vLLM import: a request without it is served as
vLLM always serves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from kvrag.errors import InvalidRequestError

PARAMS_KEY = "kvrag"  # kv_transfer_params["kvrag"]


@dataclass(frozen=True, slots=True)
class Piece:
    """One stored entry placed in the prompt: its KV (keys encoded at `start`) moves to `position`."""

    key: str  # the store key of the entry (kvrag's chunk key; the prefix has its own)
    start: int  # the position its keys were encoded at (len(prefix) for a chunk, 0 for the prefix)
    position: int  # its first token's position in this prompt
    length: int  # its tokens


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """The reused head of a prompt: the pieces, in order, covering tokens 0..reused-1 exactly."""

    pieces: tuple[Piece, ...]
    encoder: str  # the encoder id the entries must have been written for (model fingerprint and prefix)

    def __post_init__(self) -> None:
        at = 0
        for piece in self.pieces:
            if piece.position != at or piece.length < 1:
                raise InvalidRequestError(f"a transfer plan's pieces must tile the prompt's head: {self.pieces}")
            at += piece.length

    @property
    def reused(self) -> int:
        """Tokens at the head of the prompt whose KV comes from the store."""
        return sum(p.length for p in self.pieces)

    @property
    def salt(self) -> str:
        """vLLM's `cache_salt` for the request: its blocks hash apart from every exact prompt's."""
        body = json.dumps([asdict(p) for p in self.pieces], sort_keys=True).encode()
        return "kvrag-" + hashlib.sha256(body).hexdigest()[:32]

    def to_params(self) -> dict[str, Any]:
        return {PARAMS_KEY: {"encoder": self.encoder, "pieces": [asdict(p) for p in self.pieces]}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> TransferPlan | None:
        """The plan in a request's kv_transfer_params, or None (a request without one)."""
        body = (params or {}).get(PARAMS_KEY)
        if not body:
            return None
        return cls(tuple(Piece(**p) for p in body["pieces"]), str(body["encoder"]))
