"""Decoding after a prefill: sampling, stop conditions and incremental detokenization.

Generated tokens take logical positions N, N+1, ... after the stitched prompt; every cached position is
lower, so decoding needs no mask. This module never builds a prompt or a cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import numpy as np
import torch
from transformers import DynamicCache

from kvrag import cpu
from kvrag.compat import with_cache
from kvrag.plan.sampling import DRAFT_TOKENS, Sampling  # noqa: F401 - where decoding reads them

def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token id from [V] logits."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    scaled = logits.float() / sampling.temperature  # finite for every temperature Sampling lets through
    probs = torch.softmax(scaled - scaled.max(), dim=-1)
    if sampling.top_p < 1:
        sorted_probs, sorted_ids = torch.sort(probs, descending=True)
        # keep a token while the mass before it is under top_p (the first token is always kept)
        drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= sampling.top_p
        sorted_probs[drop] = 0
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(sorted_ids[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def decode(
    model: torch.nn.Module,
    cache: DynamicCache,
    first_logits: torch.Tensor,
    position: int,
    sampling: Sampling,
    eos_ids: Sequence[int],
    lock: ContextManager[Any] | None = None,
    fast_decoding: bool = True,
    context: Sequence[int] = (),
) -> Iterator[int]:
    """Yield token ids: the first from `first_logits`, the rest one step each, until EOS or the limit.

    A step is `kvrag.cpu.decode`'s where it takes the model (`fast_decoding=False` forces the transformers
    forward), else a transformers forward.

    Greedy decoding on the C step speculates from `context` (the prompt's ids): a step feeds its token and up to
    `sampling.prompt_lookup` draft tokens, those that followed the latest earlier occurrence of the answer's last
    tokens in the prompt or the answer, as many as are worth their cost by how often the lookup has guessed right
    in this answer (`PromptLookup`), in one pass over the weights; the drafts the model's own picks confirm are
    kept, each confirmed one a step saved. Each fed token's logits are those a step of its own gives, bit for bit
    (the C decode step, `kvrag.cpu`), so the tokens are the same as without drafts.

    The first token is yielded before anything only the later ones need is made (the decoder, the cache's room,
    the drafts' lookup): a one-token answer makes none of it and leaves the cache as the prefill left it.
    An EOS id is yielded, then the iterator ends. The caller stops early (stop strings) by closing it.
    `lock` is held around each forward and never across a yield, so a paused or abandoned iterator
    blocks nobody and may be resumed from any thread.
    """
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=first_logits.device).manual_seed(sampling.seed)
    token = pick_token(first_logits, sampling, generator)
    step = 0  # the index of the last token yielded; the tokens before it are in the cache
    fast = None
    try:
        yield token  # before anything only the later tokens need: the first token waits for none of it
        if token in eos_ids or sampling.max_new_tokens <= 1:
            return
        if fast_decoding:
            with lock or contextlib.nullcontext():  # made once a model, and it restacks the model's weights
                fast = cpu.decoder_of(model)
                if fast is not None:
                    room = cpu.Room.of(cache, cpu.decode_room(model, sampling.max_new_tokens))
                    cos, sin = fast.rotary(position, sampling.max_new_tokens)  # [steps, d]: the positions decoded
        drafts = sampling.prompt_lookup if sampling.temperature == 0 and context and fast is not None else 0
        lookup = PromptLookup(context, sampling.max_new_tokens) if drafts else None
        if lookup is not None:
            lookup.push(token)
        while token not in eos_ids and step + 1 < sampling.max_new_tokens:
            with lock or contextlib.nullcontext():
                fed, guesses = [token], []
                if fast is None:
                    logits = _forward(model, cache, token, position + step)[None]
                elif lookup is not None and fast.batched(cos, room.keys, room.values):
                    # drafts only for tokens still to come: the last token of the answer is never fed
                    guesses = lookup.draft(min(drafts, sampling.max_new_tokens - step - 2))
                    fed += guesses[: lookup.worth(len(guesses))]
                    rows = slice(step, step + len(fed))
                    logits = fast.native.steps(fed, cos[rows], sin[rows], room.keys, room.values, room.filled + step)
                else:
                    logits = fast.step(token, cos[step], sin[step], room.keys, room.values, room.filled + step)[None]
            for i in range(len(fed)):  # fed[i]'s logits pick the next token; a draft they do not pick ends the step
                token = pick_token(logits[i], sampling, generator)
                step += 1
                yield token
                if lookup is not None:
                    lookup.push(token, guessed=guesses[i] if i < len(guesses) else None)
                if token in eos_ids or step + 1 == sampling.max_new_tokens:
                    break
                if i + 1 < len(fed) and fed[i + 1] != token:
                    break
    finally:
        if fast is not None:
            room.commit(cache, room.filled + step)  # the tokens fed so far, as a forward would have left the cache


@dataclass(slots=True)
class Decoded:
    """One answer of `decode_together`: its tokens (no EOS) and why it ended ("eos", "length" or "stop")."""

    tokens: list[int]
    finish: str = "length"


@torch.inference_mode()
def decode_together(
    model: torch.nn.Module,
    prefills: Sequence[tuple[DynamicCache, torch.Tensor, int]],
    sampling: Sampling,
    eos_ids: Sequence[int],
    lock: ContextManager[Any] | None = None,
    stopped: Callable[[int, int], bool] | None = None,
) -> list[Decoded] | None:
    """Several answers decoded side by side, each over its own prefill's (cache, first logits, next position):
    one C step a token of every answer still going (`DecodeStep.rows`, up to MAX_TOKENS a pass), so the weights
    are read once for all of them. Each answer's tokens are, bit for bit, what `decode` gives it alone (each row's
    logits are its own step's; a seeded answer samples from its own generator, as alone). `stopped(i, token)`:
    whether answer i ends at `token` (a stop string), checked after each of its tokens.

    None, having decoded nothing, where the C step does not take the model or a cache: the caller decodes each
    answer alone. No prompt-lookup drafts: the weights' pass is shared by the answers instead."""
    fast = cpu.decoder_of(model)
    if fast is None or fast.native is None or not fast.use_native or not prefills:
        return None
    native, limit = fast.native, sampling.max_new_tokens
    with lock or contextlib.nullcontext():
        rooms = [cpu.Room.of(cache, cpu.decode_room(model, limit)) for cache, _, _ in prefills]
        rotary = [fast.rotary(position, limit) for _, _, position in prefills]
    if not all(native.takes(cos[0], room.keys, room.values) for room, (cos, _) in zip(rooms, rotary)):
        return None
    generators = [
        torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None for _ in prefills
    ]
    answers = [Decoded([]) for _ in prefills]
    last = [pick_token(logits, sampling, g) for (_, logits, _), g in zip(prefills, generators)]
    steps = [0] * len(prefills)  # tokens of each answer fed into its cache
    live = []
    for i, token in enumerate(last):
        if _ended(answers[i], token, eos_ids, stopped, i, limit):
            continue
        live.append(i)
    try:
        while live:
            going = []
            for start in range(0, len(live), cpu.MAX_TOKENS):
                group = live[start : start + cpu.MAX_TOKENS]
                cos = torch.stack([rotary[i][0][steps[i]] for i in group])
                sin = torch.stack([rotary[i][1][steps[i]] for i in group])
                with lock or contextlib.nullcontext():
                    logits = native.rows(
                        [last[i] for i in group],
                        cos,
                        sin,
                        [(rooms[i].keys, rooms[i].values) for i in group],
                        [rooms[i].filled + steps[i] for i in group],
                    )
                for row, i in enumerate(group):
                    steps[i] += 1
                    last[i] = pick_token(logits[row], sampling, generators[i])
                    if not _ended(answers[i], last[i], eos_ids, stopped, i, limit):
                        going.append(i)
            live = going
    finally:
        for room, (cache, _, _), fed in zip(rooms, prefills, steps):
            room.commit(cache, room.filled + fed)  # the tokens fed, as a forward would have left the cache
    return answers


def _ended(
    answer: Decoded, token: int, eos_ids: Sequence[int], stopped: Callable[[int, int], bool] | None, i: int,
    limit: int,
) -> bool:
    """Record `token` on `answer` (not an EOS); whether the answer ends with it."""
    if token in eos_ids:
        answer.finish = "eos"
        return True
    answer.tokens.append(token)
    if stopped is not None and stopped(i, token):
        answer.finish = "stop"
        return True
    return len(answer.tokens) >= limit


class PromptLookup:
    """Draft tokens from the prompt and the answer so far (prompt-lookup decoding, as transformers'
    `prompt_lookup_num_tokens` and vLLM's n-gram speculation): the tokens that followed the latest earlier
    occurrence of the last NGRAM tokens, else of fewer.

    How many of them are worth feeding: a draft costs a share of a step (COST) and saves a whole step when it is
    confirmed, so the j-th draft is fed while the chance that the first j are all confirmed, `rate ** j`, is above
    COST. `rate` follows how often the lookup's first guess was the token the model picked (a running mean over
    the answer, updated at every token it guessed, fed or not), so an answer that quotes its prompt drafts long
    and one that does not drafts nothing after a few misses.
    """

    NGRAM = 3  # longest suffix of the answer looked up
    # an extra token's share of a step's time: 0.23 at 100 cached tokens, 0.36 at 4k (bfloat16, 2 threads,
    # SmolLM2-135M; docs/performance.md)
    COST = 0.65
    MEMORY = 0.3  # the weight of the newest guess in `rate`

    def __init__(self, context: Sequence[int], room: int) -> None:
        self.ids = np.empty(len(context) + room + 1, dtype=np.int64)
        self.ids[: len(context)] = context
        self.size = len(context)
        self.rate = 0.5  # before any guess: no draft (0.5 is under COST) until the lookup's guesses come right

    def push(self, token: int, guessed: int | None = None) -> None:
        """Append the answer's next token; `guessed`: what the lookup had drafted for it, if anything."""
        self.ids[self.size] = token
        self.size += 1
        if guessed is not None:
            self.rate += self.MEMORY * ((guessed == token) - self.rate)

    def worth(self, available: int) -> int:
        """How many of `available` drafts to feed: those whose chance of being confirmed with all before them is
        above their cost."""
        count, chance = 0, self.rate
        while count < available and chance > self.COST:
            count += 1
            chance *= self.rate
        return count

    def draft(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the ids' last n tokens (n from NGRAM
        down to 1); [] where none occurred."""
        ids, size = self.ids, self.size
        if count <= 0:
            return []
        for n in range(min(self.NGRAM, size - 1), 0, -1):
            found = ids[: size - n] == ids[size - n]  # starts s with ids[s:s+n] == the last n ids, s + n < size
            for i in range(1, n):
                found &= ids[i : size - n + i] == ids[size - n + i]
            starts = np.flatnonzero(found)
            if len(starts):
                start = int(starts[-1]) + n
                return ids[start : min(start + count, size)].tolist()
        return []


def _forward(model: torch.nn.Module, cache: DynamicCache, token: int, position: int) -> torch.Tensor:
    """Logits [V] of one token through the whole transformers forward (the cache grows by one)."""
    device = next(model.parameters()).device
    out = model(
        input_ids=torch.tensor([[token]], device=device),
        position_ids=torch.tensor([[position]], device=device),
        **with_cache(model, cache),
        use_cache=True,
    )
    return out.logits[0, -1].float()


class Detokenizer:
    """Turns a growing list of token ids into safe text pieces, holding back what a stop string may claim.

    Text is emitted only when it is final: not an incomplete UTF-8 sequence, not a possible start of a
    stop string. The pieces joined equal the final text.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already handed out
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the newly final text ('' if none). Sets `stopped` when a stop string appears."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            text = text[: min(hits)]
            self.text = text
            return self._emit(len(text))
        self.text = text
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(len(text) - hold)

    def finish(self) -> str:
        """Whatever is still held back once generation ended without a stop string."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece
