"""Run every strategy over study items and record what each one answered, against full prefill.

For each item the runner measures, through the same `KVModel.prefill` users run:
- references: closed book (the question alone) and full prefill in every order a strategy used (the given
  order, the target moved last, the score order), each with its greedy answer, the gold answer's
  log-likelihood and its next-token distributions over its own answer (kept as top-k log-probabilities);
- every (strategy, picker, budget) row: its greedy answer, the KL of its distributions from the full
  prefill of its own order, teacher-forced over that reference's answer, the gold log-likelihood change,
  how far the true target's KV lies from its full-prefill KV, the picked target, the recomputed fraction
  and the prefill time.
The new prefills of an item (references and rows) are decoded as one batch, and teacher-forced in one
forward each for the KL and the gold answer (`PaddedBatch`). Every finished record is appended to
`records[.PART].jsonl` (references to `references[.PART].jsonl`) in the cache folder at once, keyed by model,
settings and item content: a rerun redoes nothing it already has, and a run that is stopped loses only the
item in progress. Summaries are computed by kvrag.lab.study.report.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import DynamicCache

from kvrag.cache.chunks import ChunkSource
from kvrag.cache.store import MemoryStore
from kvrag.errors import ContextOverflowError, InvalidRequestError
from kvrag.lab.study.cache import RECORDS, REFERENCES, Appender, digest, read_jsonl
from kvrag.lab.study.data import StudyItem
from kvrag.lab.study.metrics import kl_topk, kv_distance, log_likelihood, normalize, token_f1, topk_logprobs
from kvrag.model.kvmodel import DEFAULT_LEAD, KVModel
from kvrag.plan.defaults import shipped_default
from kvrag.plan.pickers import get_picker
from kvrag.plan.probe import Probe
from kvrag.plan.request import Request
from kvrag.plan.strategies import get_strategy
from kvrag.run.batch import PaddedBatch
from kvrag.run.generate import Sampling
from kvrag.run.pipeline import Prefilled
from kvrag.run.recompute import Prefill, full_prefill

# "name:picker" runs a target strategy with that picker only; a bare target strategy runs once per --pickers;
# "name@lead" (after any picker) runs it over chunks encoded behind the neutral lead (KVModel(lead=...));
# "default" runs the model's shipped default (kvrag.plan.defaults), whatever it is for the model in use
DEFAULT = "default"
# "ROW+parts" answers with the row's strategy a part at a time (kvrag.plan.parts' splitter; a question it cannot
# split is answered whole), each part scored against the chunks by the embedder on its own
PARTS = "+parts"
DEFAULT_STRATEGIES = (
    "full_prefill_top1",
    "full_prefill_top3",
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
CHUNK_KV_BYTES = 2 << 30  # chunk KV kept between items (chunks recur across a built-in set's items)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the study's table: a strategy, the picker that chose its target, a budget."""

    strategy: str
    picker: str | None
    budget: float
    lead: bool = False  # chunks encoded behind the neutral lead instead of right behind the prefix
    default: bool = False  # the row named "default": the model's shipped default (strategy, picker, budget)
    parts: bool = False  # "+parts": the question split by kvrag.plan.parts and answered a part at a time

    @property
    def label(self) -> str:
        label = self.strategy + (f" ({self.picker})" if self.picker and self.strategy != "attention_select" else "")
        label += " +lead" if self.lead else ""
        label = f"default = {label}" if self.default else label
        return label + (" +parts" if self.parts else "")


@dataclass(slots=True)
class StudyConfig:
    strategies: Sequence[str] = DEFAULT_STRATEGIES
    pickers: Sequence[str] = DEFAULT_PICKERS
    budgets: Sequence[float] = (0.05,)
    max_new_tokens: int = 32  # answers end at the first line break (see StudyRunner._generate)
    kl_top_k: int = 64
    # What a row named "default" runs: the shipped default of the model in use ({strategy, picker, budget});
    # `run_study` sets it from the model (`for_model`).
    default: dict[str, Any] | None = None

    def for_model(self, weights: str) -> StudyConfig:
        """This config with `default` set to the shipped default of the model whose weights id is `weights`."""
        return self if self.default is not None else replace(self, default=shipped_default(weights))

    def rows(self) -> list[Row]:
        """Every (strategy, picker, budget) to run: target strategies once per picker; budget-free ones once."""
        for picker in self.pickers:
            get_picker(picker)
        rows = []
        for spec in self.strategies:
            spec, parts = (spec.removesuffix(PARTS), True) if spec.endswith(PARTS) else (spec, False)
            if spec == DEFAULT:
                row = self._default_row()
                row = replace(row, parts=parts or row.parts)
                rows += [row] if row not in rows else []
                continue
            body, _, encoding = spec.partition("@")
            if encoding not in ("", "lead"):
                raise InvalidRequestError(f"'{spec}': the only encoding a row may name is @lead")
            name, _, fixed = body.partition(":")
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
            budgets = self.budgets if strategy.budgeted else self.budgets[:1]
            lead = encoding == "lead"
            new = [Row(name, p, float(b), lead, parts=parts) for p in pickers for b in budgets]
            rows += [row for row in new if row not in rows]
        return rows

    def _default_row(self) -> Row:
        if self.default is None:  # names checked before the model is known: the row is made once it is
            return Row(DEFAULT, None, float(self.budgets[0]), default=True)
        d = self.default
        budget = float(d.get("budget") or self.budgets[0])
        return Row(d["strategy"], d.get("picker"), budget, default=True, parts=d.get("parts") == "auto")


@dataclass(slots=True)
class Reference:
    """Greedy generation from a plain prompt (full prefill in one order, or closed book)."""

    text: str
    tokens: list[int]
    correct: bool
    f1: float
    gold_ll: float
    ttft_s: float | None  # None: its prefill continued another order's (see StudyRunner._item)
    top_ids: list[list[int]]
    top_logp: list[list[float]]
    cache: Any = None  # the prompt's cache, while this process holds it (for KV distances)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in REFERENCE_FIELDS}


REFERENCE_FIELDS = ("text", "tokens", "correct", "f1", "gold_ll", "ttft_s", "top_ids", "top_logp")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two sequences share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _order_name(order: Sequence[int] | None) -> str:
    return "closed" if order is None else ",".join(map(str, order))


def keeping_probe(into: list[tuple[list[int], Any]]) -> type[Probe]:
    """A Probe class that appends every full prefill it makes (token ids, cache) to `into`."""

    class KeepingProbe(Probe):
        def full_prefill_made(self, ids: list[int], cache: DynamicCache) -> None:
            into.append((ids, cache))

    return KeepingProbe


class StudyRunner:
    """Runs the rows of a config over items with one model and one embedder (the retriever's scores).

    Args:
        kv: the model.
        embedder: scores chunks against the question (any object with `embed(texts) -> [N, d]` unit rows).
        config: strategies, pickers, budgets, generation length.
        cache_dir: where records and references are appended (kept between runs).
        part: names the files this runner appends to (`records.PART.jsonl`), so that several processes can share
            one cache folder; every `records*.jsonl` in it is read.
    """

    def __init__(
        self, kv: KVModel, embedder: Any, config: StudyConfig, cache_dir: str | Path, *, part: str = ""
    ) -> None:
        self.kv, self.embedder, self.config = kv, embedder, config
        self.rows = config.rows()
        self.cache_dir = Path(cache_dir)
        self.records = read_jsonl(self.cache_dir, RECORDS)
        self.references = read_jsonl(self.cache_dir, REFERENCES)
        self.files = [self.cache_dir / f"{name}{'.' + part if part else ''}.jsonl" for name in (RECORDS, REFERENCES)]
        self._sources: dict[str, ChunkSource] = {}  # encoder id -> chunk KV kept in memory between items
        self._lead_kv: KVModel | None = None
        self._vectors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.settings = digest(kv.fingerprint.digest, kv.layout.prefix_ids, config.max_new_tokens, config.kl_top_k, 2)
        vocab = kv.tokenizer.get_vocab().values()
        # tokens whose text holds a line break: the answer ends there (a small model goes on with invented turns)
        self.stop_ids = {i for i in vocab if "\n" in kv.tokenizer.decode([i])} | set(kv.eos_ids)

    # -- keys ------------------------------------------------------------------------------------------

    def item_key(self, item: StudyItem) -> str:
        return digest(self.settings, item.to_dict())

    def record_key(self, item: StudyItem, row: Row) -> str:
        if row.parts:
            return digest(self.item_key(item), row.strategy, row.picker, row.budget, row.default, "parts")
        if row.default:
            return digest(self.item_key(item), row.strategy, row.picker, row.budget, "default")
        if row.lead:
            return digest(self.item_key(item), row.strategy, row.picker, row.budget, "lead")
        return digest(self.item_key(item), row.strategy, row.picker, row.budget)

    def done(self, item: StudyItem) -> bool:
        return all(self.record_key(item, row) in self.records for row in self.rows)

    def cached(self, items: Iterable[StudyItem]) -> list[dict[str, Any]]:
        """The records the cache holds for these items (what `run` returns, without running anything)."""
        keys = (self.record_key(item, row) for item in items for row in self.rows)
        return [self.records[key] for key in keys if key in self.records]

    # -- running ---------------------------------------------------------------------------------------

    def run(
        self, items: Iterable[StudyItem], *, on_item: Callable[[StudyItem, str | None], None] | None = None
    ) -> list[dict[str, Any]]:
        """Run every row over every item; return the records (cached ones included), one per item and row.

        An item the model cannot take (its prompt is longer than the context) is skipped and reported through
        `on_item(item, reason)`; `on_item(item, None)` follows every item that finished.
        """
        out: list[dict[str, Any]] = []
        records, references = (Appender(path) for path in self.files)
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

    def _item(self, item: StudyItem, records: Appender, references: Appender) -> list[dict[str, Any]]:
        todo = [(row, self.record_key(item, row)) for row in self.rows]
        out = [self.records[k] for _, k in todo if k in self.records]
        todo = [(row, k) for row, k in todo if k not in self.records]
        if not todo:  # every row is in the cache: nothing to prefill, not even a reference
            return out
        started = time.perf_counter()
        run = _ItemRun(self, item)
        run.reference(None)
        run.reference(run.given)  # the first order: always a whole prefill, timed (every row's full_prefill_ttft_s)
        whole = [(row, key) for row, key in todo if not row.parts]
        runs = [run.row(row) for row, _ in whole]
        fresh = run.finish(whole, runs, references)
        fresh += [run.parts_record(row, key) for row, key in todo if row.parts]
        seconds = time.perf_counter() - started
        for record in fresh:  # the item's compute time, references included, on each of its new records
            record["item_s"] = seconds
            self.records[record["key"]] = record
            records(record)
            out.append(record)
        return out

    # -- model work ------------------------------------------------------------------------------------

    def generate(self, batch: PaddedBatch) -> list[tuple[str, list[int]]]:
        """Each row's greedy answer, up to its first line break or EOS: the text, and the tokens (the stopping
        token included) that the teacher-forced passes then force."""
        tokens = batch.greedy(self.config.max_new_tokens, self.stop_ids, lock=self.kv.lock)
        return [
            (self.kv.tokenizer.decode([t for t in ts if t not in self.stop_ids], skip_special_tokens=True).strip(), ts)
            for ts in tokens
        ]

    def model(self, lead: bool) -> KVModel:
        """The study's model, or the same model encoding chunks behind the neutral lead."""
        if not lead:
            return self.kv
        if self._lead_kv is None:
            self._lead_kv = self.kv.with_lead(DEFAULT_LEAD)
        return self._lead_kv

    def chunk_kv(self, texts: list[str], model: KVModel) -> list:
        """The chunks' KV under `model`, kept between items (built-in items share chunks)."""
        source = self._sources.get(model.encoder_id)
        if source is None:
            source = self._sources[model.encoder_id] = ChunkSource(model, MemoryStore(CHUNK_KV_BYTES))
        with model.lock:
            return source.chunks(texts).kv()

    def scores(self, question: str, texts: list[str]) -> list[float]:
        missing = [t for t in dict.fromkeys(texts) if t not in self._vectors]
        if missing:
            for text, vector in zip(missing, torch.as_tensor(self.embedder.embed(missing))):
                self._vectors[text] = vector
        while len(self._vectors) > 20_000:
            self._vectors.popitem(last=False)
        q = torch.as_tensor(self.embedder.embed([question]))[0]
        return [float(self._vectors[t] @ q) for t in texts]


class _ItemRun:
    """One item's work: its references (closed book, full prefill in every order a row used) and its rows,
    decoded and teacher-forced together."""

    def __init__(self, runner: StudyRunner, item: StudyItem) -> None:
        self.runner, self.item, self.kv = runner, item, runner.kv
        kv = self.kv
        self.texts = [c.text for c in item.chunks]
        self.ids = [kv.chunk_ids(i, t) for i, t in enumerate(self.texts)]
        total = len(kv.prefix) + sum(map(len, self.ids)) + len(kv.layout.suffix_ids(item.question))
        if total + runner.config.max_new_tokens > kv.max_positions:
            raise ContextOverflowError(
                f"item {item.id}: {total + runner.config.max_new_tokens} tokens do not fit the "
                f"{kv.max_positions}-token context"
            )
        self.key = runner.item_key(item)
        self.target = item.target_index
        self.gold = list(kv.tokenizer(item.gold_text(), add_special_tokens=False)["input_ids"])
        self.targets = item.target_indices  # every chunk the answer needs (the first is `target`)
        self.given = list(range(len(self.ids)))
        self.refs: dict[str, Reference] = {}
        self.fresh_refs: dict[str, tuple[Prefill, float | None]] = {}  # name -> prefill, its time to first token
        # (token ids, cache) of full prefills made for this item, which a reference can continue from
        self.sources: list[tuple[list[int], Any]] = []
        self.scores = runner.scores(item.question, self.texts)

    def reference(self, order: Sequence[int] | None) -> None:
        """The reference's prefill, or its cached result (a rerun).

        A prompt that starts with the same tokens as a full prefill already made for this item (another
        order's reference, or an oracle strategy's full prefill) continues that prefill's cache from where
        they part: prefix caching, the same attention to rounding. Only a prefill of the whole prompt is timed.
        """
        name = _order_name(order)
        if name in self.refs or name in self.fresh_refs:
            return
        cached = self.runner.references.get(digest(self.key, name))
        if cached is not None:
            self.refs[name] = Reference(**{k: cached[k] for k in REFERENCE_FIELDS})
            return
        kv = self.kv
        if order is None:
            prompt = kv.layout.closed_book_ids(self.item.question)
        else:
            prompt = kv.prompt_ids(self.item.question, self.ids, order)
        shared, source = max(
            ((_common_prefix(prompt, i), c) for i, c in self.sources), key=lambda s: s[0], default=(0, None)
        )
        shared = min(shared, len(prompt) - 1)  # at least the last token is run, for its logits
        with kv.lock:
            t0 = time.perf_counter()
            out = full_prefill(kv.model, prompt, cache=source, shared=shared)
            int(torch.argmax(out.logits[-1]))
        self.fresh_refs[name] = (out, None if shared else time.perf_counter() - t0)
        if order is not None:  # (the closed book shares no more than a template's first tokens)
            self.sources.append((prompt, out.cache))

    def request(self, row: Row, sampling: Sampling | None = None) -> tuple[KVModel, Request]:
        """The row's model and its request over the item's chunk KV (kept between items)."""
        model = self.runner.model(row.lead)
        request = Request(
            self.item.question,
            self.runner.chunk_kv(self.texts, model),
            strategy=row.strategy,
            picker=row.picker,
            target=self.target,
            scores=self.scores,
            budget=row.budget,
            sampling=sampling or Sampling(),
        )
        return model, request

    def row(self, row: Row) -> tuple[Prefilled, float]:
        """One row's prefill (timed to its first token, as a user's ttft counts it); its order's reference."""
        model, request = self.request(row)
        t0 = time.perf_counter()
        pre = model.prefill(request, probe=keeping_probe(self.sources))
        int(torch.argmax(pre.prefill.logits[-1]))
        ttft = time.perf_counter() - t0
        self.reference(pre.decision.plan.order)
        return pre, ttft

    def record_head(self, row: Row, key: str) -> dict[str, Any]:
        """What every record of this item starts with: the item, its references' outcomes and the row."""
        closed, base = self.refs["closed"], self.refs[_order_name(self.given)]
        item = self.item
        return {
            "key": key,
            "item": item.id,
            "family": item.family,
            "variant": item.variant,
            "kind": item.kind,
            "closed_book_correct": closed.correct,
            "closed_book_agrees": normalize(closed.text) == normalize(base.text),
            "full_prefill_correct": base.correct,
            "strategy": row.strategy,
            "picker": row.picker,
            "budget": row.budget,
            "lead": row.lead,
            "default": row.default,
        }

    def parts_record(self, row: Row, key: str) -> dict[str, Any]:
        """A "+parts" row: the question split and answered a part at a time over the item's chunk KV (each part's
        retrieval scores its own question's), greedy to a line break; scored on the parts' answers together.
        The teacher-forced measures (KL, gold log-likelihood) are a whole prompt's and are left out."""
        from kvrag.answer import last_answer
        from kvrag.plan.parts import split
        from kvrag.run.pipeline import answer_parts, stream

        model, request = self.request(row, Sampling(max_new_tokens=self.runner.config.max_new_tokens, stop=["\n"]))
        parts = split(self.item.question)
        chunks = model.source.chunks(request.chunks)
        t0 = time.perf_counter()
        if parts is None:
            answer = last_answer(stream(model, request, chunks, model.executor, started_at=t0))
            answers = [answer]
        else:
            answer = answer_parts(
                model, request, parts, chunks, model.executor, started_at=t0,
                scores_of=lambda question: self.runner.scores(question, self.texts),
            )
            answers = answer.parts
        text = " ".join(answer.text.split())
        base = self.refs[_order_name(self.given)]
        picked = [a.stats.target for a in answers if a.stats.target is not None]
        read = {c for a in answers for c in a.stats.order}
        return {
            **self.record_head(row, key),
            "parts": len(answers) if parts is not None else 0,  # 0: answered whole (the splitter left it)
            "composed": answer.composed,  # lines, code (a comparison decided from numbers) or model
            "own_order": list(answers[0].stats.order),
            "own_order_full_prefill_correct": base.correct,
            "full_prefill_text": base.text,
            "agrees": normalize(text) == normalize(base.text),
            "agrees_own_order": normalize(text) == normalize(base.text),
            "agreement_f1": token_f1(text, [base.text]),
            "kl": None,
            "gold_ll": None,
            "gold_ll_delta": None,
            "target_kv_distance": None,
            "picked": picked[0] if picked else None,
            "target": self.target,
            "picker_correct": None if not picked else picked[0] in self.targets,
            "targets": self.targets,
            "picked_set": picked or None,
            "picked_recall": None if not picked else sum(t in picked for t in self.targets) / len(self.targets),
            "targets_read": sum(t in read for t in self.targets) / len(self.targets),
            "recomputed_fraction": answer.stats.recomputed_tokens / max(1, answer.stats.context_tokens),
            "extra_token_layers": answer.stats.extra_token_layers,
            "ttft_s": answer.stats.ttft_s,
            "answer_s": answer.stats.total_s,
            "full_prefill_ttft_s": base.ttft_s,
            "text": text,
            "correct": self.item.is_correct(text),
            "f1": self.item.f1(text),
        }

    def finish(
        self, todo: list[tuple[Row, str]], runs: list[tuple[Prefilled, float]], references: Appender
    ) -> list[dict[str, Any]]:
        """Decode every new prefill as one batch, score it, write the new references; the rows' records."""
        # One batch for every new prefill, references and strategies together: the greedy answers, then the
        # teacher-forced passes (each over its own-order reference's answer, and over the gold answer).
        ref_names = list(self.fresh_refs)
        prefills = [self.fresh_refs[name][0] for name in ref_names] + [pre.prefill for pre, _ in runs]
        answers: list[tuple[str, list[int]]] = []
        forced: list[torch.Tensor] = []
        gold_logits: list[torch.Tensor] = []
        if prefills:
            batch = PaddedBatch.of_prefills(self.kv.model, prefills, room=self.runner.config.max_new_tokens)
            answers = self.runner.generate(batch)
            for name, (text, tokens) in zip(ref_names, answers):  # scored below, once the passes are done
                self.refs[name] = Reference(
                    text=text,
                    tokens=tokens,
                    correct=self.item.is_correct(text),
                    f1=self.item.f1(text),
                    gold_ll=0.0,
                    ttft_s=self.fresh_refs[name][1],
                    top_ids=[],
                    top_logp=[],
                    cache=self.fresh_refs[name][0].cache,
                )
            own = [self.refs[name] for name in ref_names]
            own += [self.refs[_order_name(pre.decision.plan.order)] for pre, _ in runs]
            forced = batch.teacher_forced([ref.tokens[:-1] for ref in own], lock=self.kv.lock)
            gold_logits = batch.teacher_forced([self.gold[:-1]] * len(prefills), lock=self.kv.lock)
            del batch
        top_k = self.runner.config.kl_top_k
        for i, name in enumerate(ref_names):
            ref = self.refs[name]
            ref.top_ids, ref.top_logp = topk_logprobs(forced[i][: len(ref.tokens)], top_k)
            ref.gold_ll = log_likelihood(gold_logits[i], self.gold)
            references({"key": digest(self.key, name), "item": self.item.id, "order": name, **ref.to_json()})
        self.fresh_refs.clear()
        n = len(ref_names)
        return [
            self.record(row, rkey, pre, ttft, text, forced[n + i], gold_logits[n + i])
            for i, ((row, rkey), (pre, ttft), (text, _)) in enumerate(zip(todo, runs, answers[n:]))
        ]

    def record(
        self,
        row: Row,
        key: str,
        pre: Prefilled,
        ttft: float,
        text: str,
        forced: torch.Tensor,
        gold_logits: torch.Tensor,
    ) -> dict[str, Any]:
        """What one row answered and cost on this item, against its references."""
        item, target = self.item, self.target
        base = self.refs[_order_name(self.given)]
        order = list(pre.decision.plan.order)
        ref = self.refs[_order_name(order)]
        gold_ll = log_likelihood(gold_logits, self.gold)
        return {
            **self.record_head(row, key),
            "own_order": order,
            "own_order_full_prefill_correct": ref.correct,
            "full_prefill_text": base.text,
            # the answer a user would have got from full prefill over the same chunks, normalized as scoring
            "agrees": normalize(text) == normalize(base.text),
            "agrees_own_order": normalize(text) == normalize(ref.text),
            "agreement_f1": token_f1(text, [base.text]),  # graded: the same words, not all of them
            "kl": kl_topk(ref.top_ids, ref.top_logp, forced),
            "gold_ll": gold_ll,
            "gold_ll_delta": gold_ll - ref.gold_ll,
            "target_kv_distance": self.target_distance(pre.prefill, ref, order),
            "picked": pre.decision.target,
            "target": target,
            "picker_correct": None if pre.decision.target is None else pre.decision.target in self.targets,
            "targets": self.targets,
            "picked_set": pre.decision.targets,
            # of the chunks the answer needs, the share the picker chose (set recall; None without a picker)
            "picked_recall": None
            if pre.decision.targets is None
            else sum(t in pre.decision.targets for t in self.targets) / len(self.targets),
            # of the chunks the answer needs, the share the plan put in its context (set recall)
            "targets_read": sum(t in order for t in self.targets) / len(self.targets),
            "recomputed_fraction": pre.prefill.recomputed_tokens / pre.context_tokens if pre.context_tokens else 0.0,
            "extra_token_layers": pre.probe.extra_token_layers,
            "ttft_s": ttft,
            "full_prefill_ttft_s": base.ttft_s,  # the given order's: every order's prompt is as long
            "text": text,
            "correct": item.is_correct(text),
            "f1": item.f1(text),
        }

    def target_distance(self, prefill: Prefill, ref: Reference, order: list[int]) -> float | None:
        """||target KV - its full-prefill KV|| / ||full-prefill KV|| (None when the plan left the target out)."""
        target, ids, kv = self.target, self.ids, self.kv
        if target not in order:
            return None
        start = len(kv.prefix) + sum(len(ids[c]) for c in order[: order.index(target)])
        span = torch.arange(start, start + len(ids[target]))
        if ref.cache is None:  # the reference came from an earlier run: rebuild its prompt cache
            with kv.lock:
                ref.cache = full_prefill(kv.model, kv.prompt_ids(self.item.question, ids, order)).cache
        physical = span
        if prefill.key_positions is not None:
            physical = torch.argsort(prefill.key_positions.cpu())[span]
        return kv_distance(prefill.cache, physical, ref.cache, span)
