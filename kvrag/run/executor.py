"""The execution side of the seam: run a checked plan over resolved chunk KV, then decode.

Planning (`kvrag.plan.planner`) decides the order and the token set S; an executor carries a `Job` out and
never decides anything. `HFExecutor` runs it in-process through the transformers forward (the one
primitive, `kvrag.model.recompute`); another executor (a serving engine) implements the same three calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

import torch

from kvrag.cache.kv import ChunkKV, StoredChunk
from kvrag.model.recompute import Prefill, Workspace, full_prefill, recompute
from kvrag.model.runtime import ModelRuntime
from kvrag.plan.sampling import Sampling
from kvrag.run.generate import decode
from kvrag.timing import Phases, phase

@dataclass(slots=True)
class Job:
    """A plan made concrete: the chunks of the prompt in stitched order, what to recompute, the suffix."""

    chunk_ids: list[list[int]]  # token ids of each chunk in the prompt, first to last
    # their KV, after the plan's replacements (empty for a full prefill); a StoredChunk for each reused chunk the
    # store holds, only for an executor that reads the store itself
    chunks: list[ChunkKV | StoredChunk]
    suffix_ids: list[int]  # the question template's ids, always computed
    recompute: dict[int, torch.Tensor] = field(default_factory=dict)  # position in `chunks` -> sorted offsets in S
    key_scale: dict[int, float] = field(default_factory=dict)  # position in `chunks` -> factor on its reused keys
    full_prefill: bool = False  # one plain forward over prefix + chunk_ids + suffix instead
    room: int = 0  # tokens that will be decoded after the prompt
    logits_to_keep: int = 1  # last positions whose logits the prefill returns

    @property
    def context_tokens(self) -> int:
        return sum(map(len, self.chunk_ids))


class Executor(Protocol):
    """What runs a Job: a prefill, the decoding after it, and the release of what the prefill holds.

    `reads_store`: the executor reads reused chunks' KV from the store itself (a serving engine's connector):
    kvrag then only makes sure each is stored, and hands it over as a `StoredChunk`, never reading it.
    """

    reads_store: bool

    def prefill(self, job: Job, *, phases: Phases | None = None, pooled: bool = False) -> Prefill:
        """The prompt's prefill: logits of its last positions and a cache to decode on."""
        ...

    def decode(self, prefill: Prefill, sampling: Sampling) -> Iterator[int]:
        """Token ids after the prompt, EOS included when it comes; the caller may close the iterator early."""
        ...

    def release(self, prefill: Prefill) -> None:
        """Nothing reads the prefill's cache any more."""
        ...


class HFExecutor:
    """Runs jobs in-process on a model runtime's transformers model (callers hold the model's lock for `prefill`).

    `pooled=True` writes the stitched cache into buffers reused from one answer to the next (give them back
    with `release`); a caller that keeps several prefills alive at once (the study) leaves it off.
    """

    reads_store = False

    def __init__(self, runtime: ModelRuntime) -> None:
        self.kvmodel = runtime  # the model runtime it runs on (a KVModel is one)
        self.workspace = Workspace()

    def prefill(self, job: Job, *, phases: Phases | None = None, pooled: bool = False) -> Prefill:
        kv = self.kvmodel
        if job.full_prefill:
            ids = kv.prompt_of(job.chunk_ids, job.suffix_ids)
            with phase(phases, "forward"):
                out = full_prefill(kv.model, ids, logits_to_keep=job.logits_to_keep)
            out.recomputed_tokens = job.context_tokens
            return out
        chunks = [c for c in job.chunks if isinstance(c, ChunkKV)]
        if len(chunks) != len(job.chunks):
            raise TypeError("HFExecutor reads no store: give it every chunk's KV (reads_store is False)")
        return recompute(
            kv.model,
            kv.repositioner,
            kv.prefix,
            chunks,
            list(range(len(chunks))),
            job.recompute,
            job.suffix_ids,
            logits_to_keep=job.logits_to_keep,
            room=job.room,
            phases=phases,
            workspace=self.workspace if pooled else None,
            key_scale=job.key_scale,
        )

    def decode(self, prefill: Prefill, sampling: Sampling) -> Iterator[int]:
        kv = self.kvmodel
        return decode(
            kv.model,
            prefill.cache,
            prefill.logits[-1],
            prefill.next_position,
            sampling,
            kv.eos_ids,
            lock=kv.lock,
            context=prefill.prompt_ids or (),
        )

    def release(self, prefill: Prefill) -> None:
        self.workspace.give_back(prefill.cache)
