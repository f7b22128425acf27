"""Repair strategies as plans: where each chunk goes (the order) and which context tokens are recomputed (S).

A strategy only decides; `kvrag.model.recompute` carries the plan out, and `kvrag.plan.probe` measures what a
strategy asks of the model. Strategies live in a registry, so a user adds one with
`@register_strategy("name")` without touching the engine.

Budget rule: a budget is a fraction of the context (chunk) tokens; a budgeted strategy recomputes at most
floor(budget x context tokens). The target strategies recompute the whole target even when it is longer
than the budget and the answer's stats report the overspend; with `strict=True` they recompute only the
target's first budget tokens: a chunk encoded alone is most wrong at its start, where its first tokens
acted as an attention sink that the stitched sequence does not have (EPIC); the question then reads a
target whose start is repaired (the target's later tokens keep their stored KV). A budget under one token
makes strict target_recompute a pure move of the target (0 recomputed, shown in the stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from kvrag.cache.kv import ChunkKV, ids_digest
from kvrag.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvrag.plan.probe import Probe


@dataclass(slots=True)
class PlanRequest:
    """What a strategy may look at."""

    lengths: list[int]  # token count of each chunk, in the given order
    target: int | None  # index of the picked target (strategies that need one always get one)
    budget: float  # fraction of context tokens that may be recomputed
    scores: list[float] | None = None  # retrieval scores, one a chunk, when known
    strict: bool = False  # never exceed the budget, even to recompute a long target whole
    probe: Probe | None = None  # model measurements (deviation, attention, full-prefill KV), costed
    targets: list[int] | None = None  # every picked chunk, best first (a set picker's; else [target])

    @property
    def budget_tokens(self) -> int:
        return int(self.budget * sum(self.lengths) + 1e-9)


@dataclass(slots=True)
class Plan:
    """A strategy's decision."""

    order: list[int]  # chunk indices, first to last in the stitched sequence
    recompute: dict[int, torch.Tensor] = field(default_factory=dict)  # chunk index -> sorted offsets in S
    replace: dict[int, ChunkKV] = field(default_factory=dict)  # chunk index -> KV used instead of the stored one
    full_prefill: bool = False  # run one plain forward over the whole prompt instead (the reference)
    # chunk index -> factor on its reused keys (1 / attention temperature): every query's logits on that chunk's
    # stored tokens are multiplied by it, in the prefill and in decoding alike (APE-style); recomputed tokens
    # and the prefix are never scaled
    key_scale: dict[int, float] = field(default_factory=dict)
    # no chunk bears on the question: the answer says the documents do not say (the plan's answer is kept as a draft)
    abstain: bool = False
    reason: str = ""  # why this plan, in a line (a strategy that chooses by need says what it saw)
    signals: dict[str, float] = field(default_factory=dict)  # what it measured to choose, by name


@dataclass(frozen=True, slots=True)
class Strategy:
    """A named plan builder."""

    name: str
    build: Callable[[PlanRequest], Plan]  # the plan for one request
    needs_target: bool  # whether a picker must choose a target first
    description: str  # one line, shown in errors and the CLI
    picker: str | None = None  # a picker this strategy always uses (attention_select), else the caller's
    budgeted: bool = True  # whether its plan depends on the budget (run non-strict); studies run it at each budget
    reads_kv: bool = True  # whether its plans reuse stored chunk KV (a full prefill's never do)
    # a plan made before any picker runs, where it applies (None: the picker runs, then `build`); its request has no
    # target. by_need's reads a document encoded in its context whole, so no likelihood pass is paid for it
    before_pick: Callable[[PlanRequest], Plan | None] | None = None


STRATEGIES: dict[str, Strategy] = {}
_SHIPPED: list[str] = []  # names registered by kvrag's own modules, first registration first
# Attention temperature on reused chunks for the tempered strategies: their keys are multiplied by 1 / T.
# T < 1 sharpens the question's attention on stored chunks (APE reports T near 0.9 on Llama-3-8B).
TEMPER_T = 0.9


def register_strategy(
    name: str,
    *,
    needs_target: bool = False,
    description: str = "",
    picker: str | None = None,
    budgeted: bool = True,
    reads_kv: bool = True,
    before_pick: Callable[[PlanRequest], Plan | None] | None = None,
) -> Callable[[Callable[[PlanRequest], Plan]], Callable[[PlanRequest], Plan]]:
    """Register a plan builder under `name` (replacing any earlier one of that name).

    Example:
        >>> @register_strategy("first_chunk_recompute", description="recompute the first chunk")
        ... def first_chunk(request):
        ...     return Plan(order=list(range(len(request.lengths))),
        ...                 recompute={0: torch.arange(request.lengths[0])})
    """

    def add(build: Callable[[PlanRequest], Plan]) -> Callable[[PlanRequest], Plan]:
        STRATEGIES[name] = Strategy(
            name,
            build,
            needs_target,
            description or (build.__doc__ or "").strip(),
            picker,
            budgeted,
            reads_kv,
            before_pick,
        )
        if build.__module__.startswith("kvrag.") and name not in _SHIPPED:
            _SHIPPED.append(name)
        return build

    return add


def get_strategy(name: str) -> Strategy:
    """The registered strategy `name`, or an error listing what is accepted."""
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name (a list)
        raise InvalidRequestError(f"unknown strategy '{name}': use one of {', '.join(sorted(STRATEGIES))}") from None


# -- helpers ----------------------------------------------------------------------------------------------


def given_order(request: PlanRequest) -> list[int]:
    return list(range(len(request.lengths)))


def target_last(request: PlanRequest) -> list[int]:
    target = target_of(request)
    return [i for i in range(len(request.lengths)) if i != target] + [target]


def best_first(n: int, scores: Sequence[float] | None) -> list[int]:
    """Chunk indices by retrieval score, best first (ties: the earlier chunk); with no scores, a ranked list's order."""
    return list(range(n)) if scores is None else sorted(range(n), key=lambda i: (-scores[i], i))


# The most chunks a pass over "every retrieved chunk" scores (the likelihood behind each: `likelihood_all`,
# `by_need`): the retriever's best MOST_SCORED. At a usual top-k every chunk is scored; a long list given whole (a
# 32k-token context of 160 chunks) costs the pass over these alone, so the first token stays flat in its size.
MOST_SCORED = 32


def scored(n: int, scores: Sequence[float] | None) -> list[int] | None:
    """Of `n` chunks, those a pass over every retrieved chunk scores: None (all of them) up to MOST_SCORED, else
    the retriever's best MOST_SCORED."""
    return None if n <= MOST_SCORED else sorted(best_first(n, scores)[:MOST_SCORED])


def by_score(request: PlanRequest) -> list[int]:
    """Chunk indices best first: by retrieval score, or the given order when the list is ranked best-first."""
    return best_first(len(request.lengths), request.scores)


def target_of(request: PlanRequest) -> int:
    """The picked target of a strategy registered with needs_target=True."""
    if request.target is None:
        raise InvalidRequestError("this strategy needs a target: register it with needs_target=True")
    return request.target


def _probe(request: PlanRequest) -> Probe:
    if request.probe is None:
        raise InvalidRequestError("this strategy measures the model: run it through KVModel, which passes a probe")
    return request.probe


def offsets_to_chunks(order: Sequence[int], lengths: Sequence[int], flat: torch.Tensor) -> dict[int, torch.Tensor]:
    """Offsets into the stitched context (chunks in `order`) as chunk index -> sorted local offsets."""
    plan: dict[int, torch.Tensor] = {}
    flat = torch.sort(flat.to("cpu", torch.long)).values
    at = 0
    for c in order:
        inside = flat[(flat >= at) & (flat < at + lengths[c])] - at
        if inside.numel():
            plan[c] = inside
        at += lengths[c]
    return plan


def top_deviation(
    request: PlanRequest, order: list[int], count: int, exclude: Sequence[int] = ()
) -> dict[int, torch.Tensor]:
    """The `count` context tokens whose reused values deviate most at the check layer, outside `exclude` chunks."""
    if count <= 0:
        return {}
    deviation = _probe(request).value_deviation(order)
    excluded = torch.cat([torch.full((request.lengths[c],), c in exclude) for c in order]).to(deviation.device)
    # below every real deviation (they are >= 0); a NaN (broken KV) is never preferred
    deviation = torch.where(excluded | deviation.isnan(), -1.0, deviation)
    count = min(count, int((deviation >= 0).sum()))
    return offsets_to_chunks(order, request.lengths, torch.topk(deviation, count).indices)


def _target_tokens(request: PlanRequest) -> torch.Tensor:
    target = target_of(request)
    length = request.lengths[target]
    return torch.arange(min(length, request.budget_tokens) if request.strict else length)


# -- the strategies of the study --------------------------------------------------------------------------


@register_strategy(
    "full_prefill", budgeted=False, reads_kv=False, description="the reference: every token computed, nothing reused"
)
def _full_prefill(request: PlanRequest) -> Plan:
    return Plan(order=given_order(request), full_prefill=True)


@register_strategy("reuse", budgeted=False, description="stitch the stored KV in the given order, recompute nothing")
def _reuse(request: PlanRequest) -> Plan:
    return Plan(order=given_order(request))


@register_strategy(
    "reorder",
    budgeted=False,
    description="InfoFlow-style: chunks by score, best next to the question; nothing recomputed",
)
def _reorder(request: PlanRequest) -> Plan:
    n = len(request.lengths)
    if request.scores is None:  # a list ranked best-first: reverse it
        return Plan(order=list(reversed(range(n))))
    return Plan(order=sorted(range(n), key=lambda i: (request.scores[i], -i)))  # type: ignore[index]


@register_strategy(
    "insert_full_kv",
    budgeted=False,
    needs_target=True,
    description="study oracle: target moved last, its KV replaced by its slice of a full prefill of that order",
)
def _insert_full_kv(request: PlanRequest) -> Plan:
    order = target_last(request)
    target = target_of(request)
    return Plan(order=order, replace={target: _probe(request).full_prefill_kv(order, target)})


@register_strategy(
    "spread", needs_target=True, description="the budget split evenly over the first tokens of every non-target chunk"
)
def _spread(request: PlanRequest) -> Plan:
    target = target_of(request)
    distractors = [i for i in range(len(request.lengths)) if i != target]
    if not distractors:
        return Plan(order=given_order(request))
    share, extra = divmod(request.budget_tokens, len(distractors))
    recompute = {}
    for rank, c in enumerate(distractors):
        count = min(request.lengths[c], share + (rank < extra))
        if count:
            recompute[c] = torch.arange(count)
    return Plan(order=given_order(request), recompute=recompute)


@register_strategy(
    "spread_chunks",
    needs_target=True,
    description="whole distractor chunks within the budget, best-scored (or nearest the question) first",
)
def _spread_chunks(request: PlanRequest) -> Plan:
    target = target_of(request)
    distractors = [i for i in range(len(request.lengths)) if i != target]
    if request.scores is not None:
        distractors.sort(key=lambda i: -request.scores[i])  # type: ignore[index]
    else:
        distractors.reverse()  # nearest the question first
    left, recompute = request.budget_tokens, {}
    for c in distractors:
        if request.lengths[c] <= left:
            recompute[c] = torch.arange(request.lengths[c])
            left -= request.lengths[c]
    return Plan(order=given_order(request), recompute=recompute)


@register_strategy(
    "target_recompute",
    budgeted=False,
    needs_target=True,
    description="move the picked target next to the question and recompute it against the reused cache",
)
def _target_recompute(request: PlanRequest) -> Plan:
    return Plan(order=target_last(request), recompute={target_of(request): _target_tokens(request)})


@register_strategy(
    "attention_select",
    budgeted=False,
    needs_target=True,
    picker="attention",
    description="the question's attention over the reused cache picks the target, which is moved and recomputed",
)
def _attention_select(request: PlanRequest) -> Plan:
    return _target_recompute(request)


@register_strategy(
    "token_select",
    description="CacheBlend-style: the budget's tokens with the highest value deviation at check layer 1",
)
def _token_select(request: PlanRequest) -> Plan:
    order = given_order(request)
    return Plan(order=order, recompute=top_deviation(request, order, request.budget_tokens))


@register_strategy(
    "hybrid",
    needs_target=True,
    description="target_recompute, with any budget left over spent by token_select on the other chunks",
)
def _hybrid(request: PlanRequest) -> Plan:
    order = target_last(request)
    target = target_of(request)
    target_tokens = _target_tokens(request)
    left = request.budget_tokens - int(target_tokens.numel())
    recompute = top_deviation(request, order, left, exclude=[target])
    recompute[target] = target_tokens
    return Plan(order=order, recompute=recompute)


# -- beyond the study's recipe ------------------------------------------------------------------------------


@register_strategy(
    "target_in_place",
    budgeted=False,
    needs_target=True,
    description="recompute the picked target where it stands (no move) against the reused cache",
)
def _target_in_place(request: PlanRequest) -> Plan:
    return Plan(order=given_order(request), recompute={target_of(request): _target_tokens(request)})


@register_strategy(
    "target_first",
    budgeted=False,
    needs_target=True,
    description="move the picked target first, right after the prefix, and recompute it",
)
def _target_first(request: PlanRequest) -> Plan:
    target = target_of(request)
    order = [target] + [i for i in range(len(request.lengths)) if i != target]
    return Plan(order=order, recompute={target: _target_tokens(request)})


@register_strategy(
    "target_spread",
    needs_target=True,
    description="target_recompute, plus the budget spread over the first tokens of every other chunk (EPIC-style)",
)
def _target_spread(request: PlanRequest) -> Plan:
    plan = _spread(request)  # the budget on the distractors' first tokens, where a lone chunk's false sink sits
    plan.order = target_last(request)
    plan.recompute[target_of(request)] = _target_tokens(request)
    return plan


@register_strategy(
    "top2_recompute",
    budgeted=False,
    needs_target=True,
    description="the picked target and the next best-scored chunk moved next to the question, both recomputed",
)
def _top2_recompute(request: PlanRequest) -> Plan:
    target = target_of(request)
    second = next((i for i in by_score(request) if i != target), None)
    if second is None:
        return _target_recompute(request)
    rest = [i for i in range(len(request.lengths)) if i not in (target, second)]
    lengths = request.lengths
    return Plan(
        order=[*rest, second, target],
        recompute={target: _target_tokens(request), second: torch.arange(lengths[second])},
    )


def _tempered(plan: Plan, n: int, skip: int | None = None) -> Plan:
    """The plan with every chunk's stored keys tempered, but the `skip` chunk's (the repaired target)."""
    plan.key_scale = {c: 1.0 / TEMPER_T for c in plan.order if c != skip}
    return plan


@register_strategy(
    "tempered",
    budgeted=False,
    description=f"reuse with an attention temperature T={TEMPER_T} on every stored chunk (APE-style), no recompute",
)
def _tempered_reuse(request: PlanRequest) -> Plan:
    return _tempered(Plan(order=given_order(request)), len(request.lengths))


@register_strategy(
    "target_tempered",
    budgeted=False,
    needs_target=True,
    description=f"target_recompute, with an attention temperature T={TEMPER_T} on the other chunks' stored KV",
)
def _target_tempered(request: PlanRequest) -> Plan:
    return _tempered(_target_recompute(request), len(request.lengths), skip=target_of(request))


@register_strategy(
    "target_only",
    needs_target=True,
    budgeted=False,
    description="the picked target alone behind the prefix, its stored KV as is: exactly a full prefill over that "
    "one chunk, at the cost of the suffix (a chunk encoded behind its document's earlier chunks is recomputed)",
)
def _target_only(request: PlanRequest) -> Plan:
    order = [target_of(request)]  # a lone chunk's KV, encoded behind the prefix, is its full-prefill KV
    return Plan(order=order, recompute=exact_over(request, order))


def in_place(request: PlanRequest, order: list[int]) -> set[int]:
    """The chunks of `order` whose stored KV is already their KV in a full prefill over `order`: each encoded right
    behind the prefix and exactly the chunks before it there (`ChunkKV.behind`, `start`), as a first chunk encoded
    alone is, and a document's chunks encoded in its context and read in its order are. Reads the KV of `order`'s
    chunks only. Without a probe to read them: the first chunk alone."""
    probe = request.probe
    if probe is None:
        return {order[0]}
    prefix = len(probe.prefix)
    kept, before = set(), []
    for c, kv in zip(order, probe.kv_of(order)):
        if sits_after(kv, prefix, before):
            kept.add(c)
        before += kv.token_ids.tolist()
    return kept


def sits_after(kv: ChunkKV, prefix: int, before: list[int]) -> bool:
    """Whether `kv` was encoded right behind a `prefix`-token prefix and exactly the tokens `before` (its position
    and `ChunkKV.behind`): read there, it is its full-prefill KV."""
    return kv.start == prefix + len(before) and kv.behind == ids_digest(before)


def exact_over(request: PlanRequest, order: list[int]) -> dict[int, torch.Tensor]:
    """What makes a plan over `order` exactly a full prefill over it: every chunk recomputed but those whose stored
    KV is their full-prefill KV there already (`in_place`: a first chunk encoded alone; a document's chunks encoded
    in its context, in its order). A chunk encoded behind its document's earlier chunks and read without them is
    recomputed."""
    kept = in_place(request, order)
    return {c: torch.arange(request.lengths[c]) for c in order if c not in kept}


def __getattr__(name: str) -> Any:
    if name == "BUILTIN_STRATEGIES":  # the strategies kvrag ships, in registration order (`kvrag bench`'s default):
        return tuple(_SHIPPED)  # those of this module, then `kvrag.plan.subsets` and `kvrag.plan.need` (plan/__init__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
