"""Run every strategy over study items and record what each one answered, against full prefill.

For each item the runner measures, through the same `KVModel.prefill` users run:
- references: closed book (the question alone) and full prefill in every order a strategy used (the given
  order, the target moved last, the score order), each with its greedy answer, the gold answer's
  log-likelihood and its next-token distributions over its own answer (kept as top-k log-probabilities);
- every (strategy, picker, budget) row: its greedy answer, the KL of its distributions from the full
  prefill of its own order, teacher-forced over that reference's answer, the gold log-likelihood change,
  how far the true target's KV lies from its full-prefill KV, the picked target, the recomputed fraction
  and the prefill time.
Every finished record is appended to `records.jsonl` (references to `references.jsonl`) in the cache folder
at once, keyed by model, settings and item content: a rerun redoes nothing it already has, and a run that is
stopped loses only the item in progress. Summaries are computed by kvrag.study.report.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import DynamicCache

from kvrag.errors import ContextOverflowError, InvalidRequestError
from kvrag.kv import ChunkKV
from kvrag.kvmodel import KVModel
from kvrag.pickers import get_picker
from kvrag.recompute import Stitched, full_prefill
from kvrag.strategies import get_strategy
from kvrag.study.data import StudyItem
from kvrag.study.metrics import correct, kl_topk, token_f1, topk_logprobs

# "name:picker" runs a target strategy with that picker only; a bare target strategy runs once per --pickers
DEFAULT_STRATEGIES = (
    "reuse",
    "reorder",
    "insert_full_kv",
    "spread",
    "target_recompute",
    "target_recompute:oracle",
    "token_select",
    "attention_select",
)
DEFAULT_PICKERS = ("retriever",)
# Strategies whose plan does not depend on the budget when run non-strict (a target is recomputed whole):
# run once an item and reported at every budget.
BUDGET_FREE = frozenset({"full_prefill", "reuse", "reorder", "insert_full_kv", "target_recompute", "attention_select"})
RECORDS, REFERENCES = "records.jsonl", "references.jsonl"


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the study's table: a strategy, the picker that chose its target, a budget."""

    strategy: str
    picker: str | None
    budget: float

    @property
    def label(self) -> str:
        return self.strategy + (f" ({self.picker})" if self.picker and self.strategy != "attention_select" else "")


@dataclass(slots=True)
class StudyConfig:
    strategies: Sequence[str] = DEFAULT_STRATEGIES
    pickers: Sequence[str] = DEFAULT_PICKERS
    budgets: Sequence[float] = (0.05,)
    max_new_tokens: int = 32  # answers end at the first line break (see StudyRunner._generate)
    kl_top_k: int = 64

    def rows(self) -> list[Row]:
        """Every (strategy, picker, budget) to run: target strategies once per picker; budget-free ones once."""
        for picker in self.pickers:
            get_picker(picker)
        rows = []
        for spec in self.strategies:
            name, _, fixed = spec.partition(":")
            strategy = get_strategy(name)
            pickers: list[str | None] = [None]
            if fixed:
                get_picker(fixed)
                if not strategy.needs_target or strategy.picker:
                    raise InvalidRequestError(f"'{spec}': only a strategy that takes any picker can be given one")
                pickers = [fixed]
            elif strategy.picker:
                pickers = [strategy.picker]
            elif strategy.needs_target:
                pickers = list(self.pickers)
            budgets = self.budgets[:1] if name in BUDGET_FREE else self.budgets
            rows += [Row(name, p, float(b)) for p in pickers for b in budgets if Row(name, p, float(b)) not in rows]
        return rows


@dataclass(slots=True)
class Reference:
    """Greedy generation from a plain prompt (full prefill in one order, or closed book)."""

    text: str
    tokens: list[int]
    correct: bool
    f1: float
    gold_ll: float
    ttft_s: float
    top_ids: list[list[int]]
    top_logp: list[list[float]]
    cache: Any = None  # the prompt's cache, while this process holds it (for KV distances)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in REFERENCE_FIELDS}


REFERENCE_FIELDS = ("text", "tokens", "correct", "f1", "gold_ll", "ttft_s", "top_ids", "top_logp")


def as_batch_cache(caches: Sequence[Any]) -> DynamicCache:
    """One cache of batch len(caches) from batch-one caches of equal length (copies)."""
    layers = zip(*(c.layers for c in caches))
    return DynamicCache(
        ddp_cache_data=[
            (torch.cat([layer.keys for layer in group]), torch.cat([layer.values for layer in group]))
            for group in layers
        ]
    )


def _crop(cache: Any, n: int) -> None:
    """Drop every cached token after the first n (transformers 5 crops by a negative count)."""
    extra = cache.get_seq_length() - n
    if extra > 0:
        cache.crop(-extra)


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read_jsonl(path: Path) -> dict[str, dict[str, Any]]:
    """key -> row of an append-only cache file; a line cut short by a killed process is ignored."""
    rows: dict[str, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("key"), str):
                rows[row["key"]] = row
    return rows


class _Append:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class StudyRunner:
    """Runs the rows of a config over items with one model and one embedder (the retriever's scores).

    Args:
        kv: the model.
        embedder: scores chunks against the question (any object with `embed(texts) -> [N, d]` unit rows).
        config: strategies, pickers, budgets, generation length.
        cache_dir: where records and references are appended (kept between runs).
    """

    def __init__(self, kv: KVModel, embedder: Any, config: StudyConfig, cache_dir: str | Path) -> None:
        self.kv, self.embedder, self.config = kv, embedder, config
        self.rows = config.rows()
        self.cache_dir = Path(cache_dir)
        self.records = _read_jsonl(self.cache_dir / RECORDS)
        self.references = _read_jsonl(self.cache_dir / REFERENCES)
        self._kv_cache: OrderedDict[str, ChunkKV] = OrderedDict()  # chunk text -> KV, LRU
        self._vectors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.settings = _digest(kv.fingerprint.digest, kv.layout.prefix_ids, config.max_new_tokens, config.kl_top_k, 2)
        vocab = kv.tokenizer.get_vocab().values()
        # tokens whose text holds a line break: the answer ends there (a small model goes on with invented turns)
        self.stop_ids = {i for i in vocab if "\n" in kv.tokenizer.decode([i])} | set(kv.eos_ids)

    # -- keys ------------------------------------------------------------------------------------------

    def item_key(self, item: StudyItem) -> str:
        return _digest(self.settings, item.to_dict())

    def record_key(self, item: StudyItem, row: Row) -> str:
        return _digest(self.item_key(item), row.strategy, row.picker, row.budget)

    def done(self, item: StudyItem) -> bool:
        return all(self.record_key(item, row) in self.records for row in self.rows)

    # -- running ---------------------------------------------------------------------------------------

    def run(
        self, items: Iterable[StudyItem], *, on_item: Callable[[StudyItem, str | None], None] | None = None
    ) -> list[dict[str, Any]]:
        """Run every row over every item; return the records (cached ones included), one per item and row.

        An item the model cannot take (its prompt is longer than the context) is skipped and reported through
        `on_item(item, reason)`; `on_item(item, None)` follows every item that finished.
        """
        out: list[dict[str, Any]] = []
        records, references = _Append(self.cache_dir / RECORDS), _Append(self.cache_dir / REFERENCES)
        try:
            for item in items:
                try:
                    rows = self._item(item, records, references)
                except (ContextOverflowError, InvalidRequestError) as err:
                    if on_item:
                        on_item(item, str(err))
                    continue
                out += rows
                if on_item:
                    on_item(item, None)
        finally:
            records.close()
            references.close()
        return out

    def _item(self, item: StudyItem, records: _Append, references: _Append) -> list[dict[str, Any]]:
        kv = self.kv
        texts = [c.text for c in item.chunks]
        ids = [kv.chunk_ids(i, t) for i, t in enumerate(texts)]
        suffix = kv.layout.suffix_ids(item.question)
        total = len(kv.prefix) + sum(map(len, ids)) + len(suffix) + self.config.max_new_tokens
        if total > kv.max_positions:
            raise ContextOverflowError(
                f"item {item.id}: {total} tokens do not fit the {kv.max_positions}-token context"
            )
        key = self.item_key(item)
        started = time.perf_counter()
        target = item.target_index
        gold = list(kv.tokenizer(item.answers[0].strip(), add_special_tokens=False)["input_ids"])
        given = list(range(len(ids)))
        refs: dict[str, Reference] = {}
        fresh_refs: dict[str, tuple[Stitched, float]] = {}  # name -> prefill, its time to the first token

        def order_name(order: Sequence[int] | None) -> str:
            return "closed" if order is None else ",".join(map(str, order))

        def prefill_reference(order: Sequence[int] | None) -> None:
            """The reference's prefill, or its cached result (a rerun)."""
            name = order_name(order)
            if name in refs or name in fresh_refs:
                return
            cached = self.references.get(_digest(key, name))
            if cached is not None:
                refs[name] = Reference(**{k: cached[k] for k in REFERENCE_FIELDS})
                return
            prompt = self._closed_book_ids(item.question) if order is None else kv.prompt_ids(item.question, ids, order)
            with kv.lock:
                t0 = time.perf_counter()
                stitched = full_prefill(kv.model, prompt)
                int(torch.argmax(stitched.logits[-1]))
            fresh_refs[name] = stitched, time.perf_counter() - t0

        def finish_references() -> None:
            """Generate every new reference's answer (batched per prompt length), then score and cache it."""
            by_length: dict[int, list[str]] = {}
            for name, (stitched, _) in fresh_refs.items():
                by_length.setdefault(stitched.next_position, []).append(name)
            for names in by_length.values():
                answers = self._generate_batch([fresh_refs[name][0] for name in names])
                for name, (text, tokens) in zip(names, answers):
                    stitched, ttft = fresh_refs[name]
                    n = stitched.next_position
                    logits = self._teacher_forced(stitched, tokens[:-1], n)
                    top_ids, top_logp = topk_logprobs(logits[: len(tokens)], self.config.kl_top_k)
                    ref = Reference(
                        text,
                        tokens,
                        correct(text, item.answers),
                        token_f1(text, item.answers),
                        self._gold_ll(stitched, gold, n),
                        ttft,
                        top_ids,
                        top_logp,
                        cache=stitched.cache,
                    )
                    row = {"key": _digest(key, name), "item": item.id, "order": name, **ref.to_json()}
                    references(row)
                    refs[name] = ref
            fresh_refs.clear()

        prefill_reference(None)
        prefill_reference(given)
        todo = [(row, self.record_key(item, row)) for row in self.rows]
        out = [self.records[k] for _, k in todo if k in self.records]
        todo = [(row, k) for row, k in todo if k not in self.records]
        runs = []
        if todo:
            scores = self._scores(item.question, texts)
            chunk_kv = self._chunk_kv(texts)
            for row, _ in todo:
                t0 = time.perf_counter()
                pre = kv.prefill(
                    item.question,
                    chunk_kv,
                    strategy=row.strategy,
                    picker=row.picker,
                    target=target,
                    scores=scores,
                    budget=row.budget,
                )
                int(torch.argmax(pre.stitched.logits[-1]))  # the first token, as a user's ttft counts it
                runs.append((pre, time.perf_counter() - t0))
                prefill_reference(pre.decision.plan.order)
        finish_references()
        closed, base = refs["closed"], refs[order_name(given)]
        fresh = []
        for (row, rkey), (pre, ttft) in zip(todo, runs):
            order = list(pre.decision.plan.order)
            ref = refs[order_name(order)]
            n = pre.stitched.next_position
            kl = kl_topk(ref.top_ids, ref.top_logp, self._teacher_forced(pre.stitched, ref.tokens[:-1], n))
            gold_ll = self._gold_ll(pre.stitched, gold, n)
            fresh.append(
                {
                    "key": rkey,
                    "item": item.id,
                    "family": item.family,
                    "variant": item.variant,
                    "kind": item.kind,
                    "closed_book_correct": closed.correct,
                    "full_prefill_correct": base.correct,
                    "strategy": row.strategy,
                    "picker": row.picker,
                    "budget": row.budget,
                    "own_order": order,
                    "own_order_full_prefill_correct": ref.correct,
                    "kl": kl,
                    "gold_ll": gold_ll,
                    "gold_ll_delta": gold_ll - ref.gold_ll,
                    "target_kv_distance": self._target_distance(pre.stitched, ref, item.question, ids, order, target),
                    "picked": pre.decision.target,
                    "target": target,
                    "picker_correct": None if pre.decision.target is None else pre.decision.target == target,
                    "recomputed_fraction": pre.stitched.recomputed_tokens / pre.context_tokens
                    if pre.context_tokens
                    else 0.0,
                    "extra_token_layers": pre.probe.extra_token_layers,
                    "ttft_s": ttft,
                    "full_prefill_ttft_s": ref.ttft_s,
                }
            )
        for record, (text, _) in zip(fresh, self._generate_batch([pre.stitched for pre, _ in runs])):
            record.update(text=text, correct=correct(text, item.answers), f1=token_f1(text, item.answers))
        seconds = time.perf_counter() - started
        for record in fresh:  # the item's compute time, references included, on each of its new records
            record["item_s"] = seconds
            self.records[record["key"]] = record
            records(record)
            out.append(record)
        return out

    # -- model work ------------------------------------------------------------------------------------

    def _closed_book_ids(self, question: str) -> list[int]:
        tok = self.kv.tokenizer
        if self.kv.layout.use_chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": question.strip()}], tokenize=False, add_generation_prompt=True
            )
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok(f"Question: {question.strip()}\nAnswer:")["input_ids"])

    @torch.inference_mode()
    def _teacher_forced(self, stitched: Stitched, tokens: list[int], n: int) -> torch.Tensor:
        """[1 + len(tokens), V] logits: the prefill's last row, then one row per forced token; cache kept at n."""
        rows = [stitched.logits[-1:].float()]
        if tokens:
            device = stitched.logits.device
            out = self.kv.model(
                input_ids=torch.tensor([tokens], device=device),
                position_ids=torch.arange(n, n + len(tokens), device=device).view(1, -1),
                cache=stitched.cache,
                use_cache=True,
            )
            _crop(stitched.cache, n)
            rows.append(out.logits[0].float())
        return torch.cat(rows)

    def _gold_ll(self, stitched: Stitched, gold: list[int], n: int) -> float:
        """Log-likelihood of the gold answer's tokens as the reply."""
        logits = self._teacher_forced(stitched, gold[:-1], n)
        logp = torch.log_softmax(logits, dim=-1)
        return float(logp[torch.arange(len(gold)), torch.tensor(gold)].sum())

    @torch.inference_mode()
    def _generate_batch(self, prefills: list[Stitched]) -> list[tuple[str, list[int]]]:
        """Greedy answers of prefills of one prompt length, decoded together as one batch: each up to its first
        line break or EOS, with the tokens forced for the KL (the stopping token included)."""
        if not prefills:
            return []
        n = prefills[0].next_position
        caches = [p.cache for p in prefills]
        batch = as_batch_cache(caches)
        logits = torch.stack([p.logits[-1] for p in prefills])
        device = logits.device
        tokens: list[list[int]] = [[] for _ in prefills]
        done = [False] * len(prefills)
        for step in range(self.config.max_new_tokens):
            picks = logits.argmax(-1)
            for b, token in enumerate(picks.tolist()):
                if not done[b]:
                    tokens[b].append(token)
                    done[b] = token in self.stop_ids
            if all(done) or step + 1 == self.config.max_new_tokens:
                break
            with self.kv.lock:
                out = self.kv.model(
                    input_ids=picks.view(-1, 1),
                    position_ids=torch.full((len(prefills), 1), n + step, device=device),
                    cache=batch,
                    use_cache=True,
                )
            logits = out.logits[:, -1].float()
        return [
            (self.kv.tokenizer.decode([t for t in ts if t not in self.stop_ids], skip_special_tokens=True).strip(), ts)
            for ts in tokens
        ]

    def _target_distance(
        self,
        stitched: Stitched,
        ref: Reference,
        question: str,
        ids: list[list[int]],
        order: list[int],
        target: int,
    ) -> float:
        """||target KV - its full-prefill KV|| / ||full-prefill KV||, keys and values of every layer together."""
        start = len(self.kv.prefix) + sum(len(ids[c]) for c in order[: order.index(target)])
        span = torch.arange(start, start + len(ids[target]))
        if ref.cache is None:  # the reference came from an earlier run: rebuild its prompt cache
            with self.kv.lock:
                ref.cache = full_prefill(self.kv.model, self.kv.prompt_ids(question, ids, order)).cache
        physical = span
        if stitched.key_positions is not None:
            physical = torch.argsort(stitched.key_positions.cpu())[span]
        diff = norm = 0.0
        for mine, full in zip(stitched.cache.layers, ref.cache.layers):
            for a, b in ((mine.keys, full.keys), (mine.values, full.values)):
                x, y = a[0][:, physical.to(a.device)].float(), b[0][:, span.to(b.device)].float()
                diff += float((x - y).pow(2).sum())
                norm += float(y.pow(2).sum())
        return (diff / norm) ** 0.5 if norm else 0.0

    def _chunk_kv(self, texts: list[str]) -> list[ChunkKV]:
        missing = [t for t in dict.fromkeys(texts) if t not in self._kv_cache]
        if missing:
            for text, chunk in zip(missing, self.kv.encode(missing)):
                self._kv_cache[text] = chunk
        for text in texts:
            self._kv_cache.move_to_end(text)
        while len(self._kv_cache) > 400:  # about 2 GB of fp32 KV on the default model
            self._kv_cache.popitem(last=False)
        return [self._kv_cache[t] for t in texts]

    def _scores(self, question: str, texts: list[str]) -> list[float]:
        missing = [t for t in dict.fromkeys(texts) if t not in self._vectors]
        if missing:
            for text, vector in zip(missing, torch.as_tensor(self.embedder.embed(missing))):
                self._vectors[text] = vector
        while len(self._vectors) > 20_000:
            self._vectors.popitem(last=False)
        q = torch.as_tensor(self.embedder.embed([question]))[0]
        return [float(self._vectors[t] @ q) for t in texts]
