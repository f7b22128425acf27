"""Retrieved chunks read with their run: where chunks were encoded in their document's context
(`KVRAG(encoding="document")`), a run is a stretch of one document's consecutive chunks encoded in one context
(`kvrag.model.encode.context_runs`), and its chunks stitched in order are exactly its full prefill: reading a run
whole costs no recomputation, only the question's attention over more tokens.

A retriever that returns two or more chunks of one run has found the part of the corpus the question is about, and
the chunks it missed in that run are the likeliest to hold the rest (the conversation's other sessions, the
document's field the question named in other words): those runs are read whole, as an auto-merging retriever
reads a parent where it found several of its children. A run met once stays one chunk.
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence, TypeVar

Chunk = TypeVar("Chunk", bound=Hashable)

# The most tokens the chunks given to a question may hold once runs are added: a run that would pass it is not
# added (its retrieved chunks stay). Reading costs attention only, so this bounds memory and the suffix's attention,
# not compute: 4,096 tokens of the 1.5B's KV are 117 MB in bfloat16.
MOST_TOKENS = 4096
MERGE_AT = 2  # retrieved chunks of one run that make it read whole
# Whether a question reads the runs of its retrieved chunks whole by default (`KVRAG.retrieve(whole_runs=)`). Chosen
# on the held-out choose halves, the top five retrieved (docs/study.md): as many right within one item (0.5B 24 against
# 23 of 48, 1.5B 11 against 12 of 24), the chats' first token a tenth of the plan by need's over five sessions.
WHOLE_RUNS = True


def with_runs(
    hits: Sequence[Chunk],
    run_of: Callable[[Chunk], Sequence[Chunk]],
    tokens: Callable[[Chunk], int],
    most: int = MOST_TOKENS,
) -> list[Chunk]:
    """The retrieved chunks `hits` (best first) with every run that holds MERGE_AT of them or more read whole: the
    run's chunks in document order in place of its best hit, its other hits dropped. `run_of(c)`: the chunks of
    c's run in document order (c alone where it was encoded alone). Runs are added best hit first while the chunks
    given stay within `most` tokens; one that would pass it keeps its hits as retrieved."""
    runs = {c: tuple(run_of(c)) for c in hits}
    count: dict[tuple[Chunk, ...], int] = {}
    for run in runs.values():
        count[run] = count.get(run, 0) + 1
    total = sum(tokens(c) for c in hits)
    merged: set[tuple[Chunk, ...]] = set()
    for c in hits:  # best first: the runs that fit, in the order of their best hits
        run = runs[c]
        if count[run] >= MERGE_AT and run not in merged:
            extra = sum(tokens(x) for x in run if x not in hits)
            if total + extra <= most:
                merged.add(run)
                total += extra
    out: list[Chunk] = []
    for c in hits:
        run = runs[c]
        if run in merged:
            out.extend(x for x in run if x not in out)
        elif c not in out:
            out.append(c)
    return out
