"""Scoring answers and comparing strategies: pure functions over strings, numbers and tensors.

- `contains_answer`: the normalized gold answer appears in the output as a whole-token run.
- `abstains`: the output says the context does not hold the answer.
- `token_f1`: SQuAD-style token F1 against the best gold answer.
- `wilson`: a 95% interval for a proportion; `mcnemar`: the exact two-sided McNemar test on paired outcomes;
  `bootstrap_diff`: a paired bootstrap interval for a difference of means.
- `topk_logprobs` / `kl_topk`: the teacher-forced KL of a strategy's next-token distributions from the
  reference's, over the reference's top tokens plus one bucket for the rest (stored compactly, so a rerun
  does not redo the reference).
"""

from __future__ import annotations

import math
import random
import re
import unicodedata
from collections import Counter
from typing import Any, Sequence

import torch

_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def normalize(text: str) -> list[str]:
    """Lower-cased letter/digit runs; thousands separators inside numbers are dropped ("12,000" -> "12000")."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return _WORD.findall(text)


def contains_answer(output: str, answer: str) -> bool:
    """Whether the answer's tokens occur in the output's tokens as one contiguous run."""
    gold, out = normalize(answer), normalize(output)
    if not gold:
        return False
    n = len(gold)
    return any(out[i : i + n] == gold for i in range(len(out) - n + 1))


# What an answer that declines says: kvrag's own abstention (kvrag.answer.NOT_IN_DOCUMENTS) or a model's words for it.
_ABSTAINS = re.compile(
    r"documents do not say|(does not|doesn't|do not|don't) (mention|say|state|specify|provide|contain|include)|"
    r"no (information|mention)|not (mentioned|stated|specified|provided|given|found)|cannot (find|determine)|"
    r"(isn't|is not) (mentioned|stated|specified|provided)",
    re.IGNORECASE,
)


def abstains(output: str) -> bool:
    """Whether an output says the context does not hold the answer."""
    return bool(_ABSTAINS.search(output))


def correct(output: str, answers: Sequence[str]) -> bool:
    return any(contains_answer(output, a) for a in answers)


def token_f1(output: str, answers: Sequence[str]) -> float:
    """The best token F1 of the output against any gold answer."""
    out = normalize(output)
    best = 0.0
    for answer in answers:
        gold = normalize(answer)
        same = sum((Counter(out) & Counter(gold)).values())
        if same:
            precision, recall = same / len(out), same / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of successes / n; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # at 0 or n successes the interval reaches its end exactly (the float sum lands a rounding error short)
    return 0.0 if successes == 0 else max(0.0, centre - half), 1.0 if successes == n else min(1.0, centre + half)


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> tuple[int, int, float]:
    """Exact two-sided McNemar test on paired outcomes: (a right b wrong, a wrong b right, p-value)."""
    if len(a) != len(b):
        raise ValueError("paired outcomes must have the same length")
    only_a = sum(1 for x, y in zip(a, b) if x and not y)
    only_b = sum(1 for x, y in zip(a, b) if y and not x)
    n = only_a + only_b
    if n == 0:
        return 0, 0, 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return only_a, only_b, min(1.0, 2 * tail)


def bootstrap_diff(
    a: Sequence[float], b: Sequence[float], *, rounds: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean of a - b over pairs and its 95% paired-bootstrap interval."""
    if len(a) != len(b) or not a:
        raise ValueError("paired values must be non-empty and of the same length")
    diffs = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return sum(diffs) / n, means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def topk_logprobs(logits: torch.Tensor, k: int = 64) -> tuple[list[list[int]], list[list[float]]]:
    """Per row of [T, V] logits: the ids and log-probabilities of its k most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return ids.tolist(), [[round(v, 6) for v in row] for row in values.tolist()]


def kl_topk(ref_ids: list[list[int]], ref_logp: list[list[float]], logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || strategy), the reference kept as its top tokens plus the rest.

    The distributions are compared on the reference's top-k tokens and one bucket holding all other tokens
    (a coarse-graining of the vocabulary, so the value is at most the full KL and equals it when the
    reference puts all its mass on its top k).
    """
    if not ref_ids:
        return 0.0
    logq = torch.log_softmax(logits[: len(ref_ids)].float(), dim=-1)
    total = 0.0
    for row, (ids, logp) in enumerate(zip(ref_ids, ref_logp)):
        p = torch.tensor(logp, dtype=torch.float64).exp()
        q_logp = logq[row, ids].double()
        kl = float((p * (torch.tensor(logp, dtype=torch.float64) - q_logp)).sum())
        p_rest = max(0.0, 1.0 - float(p.sum()))
        q_rest = max(1e-12, 1.0 - float(q_logp.exp().sum()))
        if p_rest > 1e-12:
            kl += p_rest * math.log(p_rest / q_rest)
        total += max(0.0, kl)
    return total / len(ref_ids)


def log_likelihood(logits: torch.Tensor, tokens: list[int]) -> float:
    """Sum of log p(token) over teacher-forced logits whose row i predicts tokens[i]."""
    logp = torch.log_softmax(logits[: len(tokens)], dim=-1)
    return float(logp[torch.arange(len(tokens)), torch.tensor(tokens, device=logp.device)].sum())


def kv_distance(mine: Any, mine_slots: torch.Tensor, full: Any, full_slots: torch.Tensor) -> float:
    """||KV - reference KV|| / ||reference KV|| over some slots of two caches, keys and values of every layer.

    `mine_slots` and `full_slots` are the physical cache slots of the same tokens in each cache.
    """
    diff = norm = 0.0
    for a_layer, b_layer in zip(mine.layers, full.layers):
        for a, b in ((a_layer.keys, b_layer.keys), (a_layer.values, b_layer.values)):
            x, y = a[0][:, mine_slots.to(a.device)].float(), b[0][:, full_slots.to(b.device)].float()  # [H, T, D]
            diff += float((x - y).pow(2).sum())
            norm += float(y.pow(2).sum())
    return (diff / norm) ** 0.5 if norm else 0.0
