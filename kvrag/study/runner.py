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
item in progress. Summaries are computed by kvrag.study.report.
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

from kvrag.batch import PaddedBatch
from kvrag.errors import ContextOverflowError, InvalidRequestError
from kvrag.kv import ChunkKV
from kvrag.kvmodel import DEFAULT_LEAD, KVModel
from kvrag.pickers import get_picker
from kvrag.recompute import Stitched, full_prefill
from kvrag.strategies import get_strategy
from kvrag.study.data import StudyItem
from kvrag.study.metrics import correct, kl_topk, normalize, token_f1, topk_logprobs

# "name:picker" runs a target strategy with that picker only; a bare target strategy runs once per --pickers;
# "name@lead" (after any picker) runs it over chunks encoded behind the neutral lead (KVModel(lead=...))
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
RECORDS, REFERENCES = "records", "references"  # cache/records[.PART].jsonl, one file a writing process


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the study's table: a strategy, the picker that chose its target, a budget."""

    strategy: str
    picker: str | None
    budget: float
    lead: bool = False  # chunks encoded behind the neutral lead instead of right behind the prefix

    @property
    def label(self) -> str:
        label = self.strategy + (f" ({self.picker})" if self.picker and self.strategy != "attention_select" else "")
        return label + (" +lead" if self.lead else "")


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
            new = [Row(name, p, float(b), lead) for p in pickers for b in budgets]
            rows += [row for row in new if row not in rows]
        return rows


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


def _log_likelihood(logits: torch.Tensor, tokens: list[int]) -> float:
    """Sum of log p(token) over teacher-forced logits whose row i predicts tokens[i]."""
    logp = torch.log_softmax(logits[: len(tokens)], dim=-1)
    return float(logp[torch.arange(len(tokens)), torch.tensor(tokens, device=logp.device)].sum())


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _read_jsonl(folder: Path, name: str) -> dict[str, dict[str, Any]]:
    """key -> row of the append-only cache files `name*.jsonl`; a line cut short by a killed process is ignored."""
    rows: dict[str, dict[str, Any]] = {}
    for path in sorted(folder.glob(f"{name}*.jsonl")):
        # records end at "\n" only (JSON escapes it in strings); str.splitlines would also cut at U+2028, U+0085
        # and other separators that a generated answer may hold, and lose that record
        for line in path.read_text(encoding="utf-8", errors="replace").split("\n"):
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
        cut = False
        if path.is_file() and path.stat().st_size:
            with path.open("rb") as existing:
                existing.seek(-1, 2)
                cut = existing.read(1) != b"\n"
        self.file = path.open("a", encoding="utf-8")
        if cut:  # a line cut short by a killed process: end it, so the next record is a line of its own
            self.file.write("\n")

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
        part: names the files this runner appends to (`records.PART.jsonl`), so that several processes can share
            one cache folder; every `records*.jsonl` in it is read.
    """

    def __init__(
        self, kv: KVModel, embedder: Any, config: StudyConfig, cache_dir: str | Path, *, part: str = ""
    ) -> None:
        self.kv, self.embedder, self.config = kv, embedder, config
        self.rows = config.rows()
        self.cache_dir = Path(cache_dir)
        self.records = _read_jsonl(self.cache_dir, RECORDS)
        self.references = _read_jsonl(self.cache_dir, REFERENCES)
        self.files = [self.cache_dir / f"{name}{'.' + part if part else ''}.jsonl" for name in (RECORDS, REFERENCES)]
        self._kv_cache: OrderedDict[tuple[str, str], ChunkKV] = OrderedDict()  # (encoder, chunk text) -> KV, LRU
        self._lead_kv: KVModel | None = None
        self._vectors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.settings = _digest(kv.fingerprint.digest, kv.layout.prefix_ids, config.max_new_tokens, config.kl_top_k, 2)
        vocab = kv.tokenizer.get_vocab().values()
        # tokens whose text holds a line break: the answer ends there (a small model goes on with invented turns)
        self.stop_ids = {i for i in vocab if "\n" in kv.tokenizer.decode([i])} | set(kv.eos_ids)

    # -- keys ------------------------------------------------------------------------------------------

    def item_key(self, item: StudyItem) -> str:
        return _digest(self.settings, item.to_dict())

    def record_key(self, item: StudyItem, row: Row) -> str:
        if row.lead:
            return _digest(self.item_key(item), row.strategy, row.picker, row.budget, "lead")
        return _digest(self.item_key(item), row.strategy, row.picker, row.budget)

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
        records, references = (_Append(path) for path in self.files)
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
        todo = [(row, self.record_key(item, row)) for row in self.rows]
        out = [self.records[k] for _, k in todo if k in self.records]
        todo = [(row, k) for row, k in todo if k not in self.records]
        if not todo:  # every row is in the cache: nothing to prefill, not even a reference
            return out
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
        fresh_refs: dict[str, tuple[Stitched, float | None]] = {}  # name -> prefill, its time to the first token

        def order_name(order: Sequence[int] | None) -> str:
            return "closed" if order is None else ",".join(map(str, order))

        # (token ids, cache) of full prefills made for this item, which a reference can continue from
        sources: list[tuple[list[int], Any]] = []

        def prefill_reference(order: Sequence[int] | None) -> None:
            """The reference's prefill, or its cached result (a rerun).

            A prompt that starts with the same tokens as a full prefill already made for this item (another
            order's reference, or an oracle strategy's full prefill) continues that prefill's cache from
            where they part: prefix caching, the same attention to rounding. Only a prefill of the whole
            prompt is timed."""
            name = order_name(order)
            if name in refs or name in fresh_refs:
                return
            cached = self.references.get(_digest(key, name))
            if cached is not None:
                refs[name] = Reference(**{k: cached[k] for k in REFERENCE_FIELDS})
                return
            if order is None:
                prompt = self._closed_book_ids(item.question)
            else:
                prompt = kv.prompt_ids(item.question, ids, order)
            shared, source = max(
                ((_common_prefix(prompt, i), c) for i, c in sources), key=lambda s: s[0], default=(0, None)
            )
            shared = min(shared, len(prompt) - 1)  # at least the last token is run, for its logits
            with kv.lock:
                t0 = time.perf_counter()
                if shared:
                    stitched = self._continue_prefill(source, prompt, shared)
                else:
                    stitched = full_prefill(kv.model, prompt)
                int(torch.argmax(stitched.logits[-1]))
            fresh_refs[name] = (stitched, None if shared else time.perf_counter() - t0)
            if order is not None:  # (the closed book shares no more than a template's first tokens)
                sources.append((prompt, stitched.cache))

        prefill_reference(None)
        prefill_reference(given)  # the first order: always a whole prefill, timed (every row's full_prefill_ttft_s)
        runs = []
        scores = self._scores(item.question, texts)
        for row, _ in todo:
            model = self._model(row.lead)
            chunk_kv = self._chunk_kv(texts, model)
            t0 = time.perf_counter()
            pre = model.prefill(
                item.question,
                chunk_kv,
                strategy=row.strategy,
                picker=row.picker,
                target=target,
                scores=scores,
                budget=row.budget,
                keep_probe_prefill=True,
            )
            int(torch.argmax(pre.stitched.logits[-1]))  # the first token, as a user's ttft counts it
            runs.append((pre, time.perf_counter() - t0))
            if pre.probe.last_full_prefill is not None:
                sources.append(pre.probe.last_full_prefill)
            prefill_reference(pre.decision.plan.order)

        # One batch for every new prefill, references and strategies together: the greedy answers, then the
        # teacher-forced passes (each over its own-order reference's answer, and over the gold answer).
        ref_names = list(fresh_refs)
        prefills = [fresh_refs[name][0] for name in ref_names] + [pre.stitched for pre, _ in runs]
        answers: list[tuple[str, list[int]]] = []
        forced: list[torch.Tensor] = []
        gold_logits: list[torch.Tensor] = []
        if prefills:
            batch = self._batch(prefills)
            answers = self._generate(batch)
            for name, (text, tokens) in zip(ref_names, answers):  # scored below, once the passes are done
                prefill, ttft = fresh_refs[name]
                refs[name] = Reference(
                    text=text,
                    tokens=tokens,
                    correct=correct(text, item.answers),
                    f1=token_f1(text, item.answers),
                    gold_ll=0.0,
                    ttft_s=ttft,
                    top_ids=[],
                    top_logp=[],
                    cache=prefill.cache,
                )
            own = [refs[name] for name in ref_names] + [refs[order_name(pre.decision.plan.order)] for pre, _ in runs]
            forced = self._forced(batch, [ref.tokens[:-1] for ref in own])
            gold_logits = self._forced(batch, [gold[:-1]] * len(prefills))
            del batch
        for i, name in enumerate(ref_names):
            ref = refs[name]
            ref.top_ids, ref.top_logp = topk_logprobs(forced[i][: len(ref.tokens)], self.config.kl_top_k)
            ref.gold_ll = _log_likelihood(gold_logits[i], gold)
            references({"key": _digest(key, name), "item": item.id, "order": name, **ref.to_json()})
        fresh_refs.clear()
        closed, base = refs["closed"], refs[order_name(given)]
        fresh = []
        for i, ((row, rkey), (pre, ttft), (text, _)) in enumerate(zip(todo, runs, answers[len(ref_names) :])):
            order = list(pre.decision.plan.order)
            ref = refs[order_name(order)]
            j = len(ref_names) + i
            gold_ll = _log_likelihood(gold_logits[j], gold)
            fresh.append(
                {
                    "key": rkey,
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
                    "own_order": order,
                    "own_order_full_prefill_correct": ref.correct,
                    "full_prefill_text": base.text,
                    # the answer a user would have got from full prefill over the same chunks, normalized as scoring
                    "agrees": normalize(text) == normalize(base.text),
                    "agrees_own_order": normalize(text) == normalize(ref.text),
                    "agreement_f1": token_f1(text, [base.text]),  # graded: the same words, not all of them
                    "kl": kl_topk(ref.top_ids, ref.top_logp, forced[j]),
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
                    "full_prefill_ttft_s": base.ttft_s,  # the given order's: every order's prompt is as long
                    "text": text,
                    "correct": correct(text, item.answers),
                    "f1": token_f1(text, item.answers),
                }
            )
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
    def _continue_prefill(self, source: Any, prompt: list[int], shared: int) -> Stitched:
        """A full prefill of `prompt` whose first `shared` tokens are those of the prompt of `source` (a full
        prefill's cache): their KV is copied from it, the rest is one forward over it."""
        cache = DynamicCache(
            ddp_cache_data=[
                (layer.keys[:, :, :shared].clone(), layer.values[:, :, :shared].clone()) for layer in source.layers
            ]
        )
        device = source.layers[0].keys.device
        out = self.kv.model(
            input_ids=torch.tensor([prompt[shared:]], device=device),
            position_ids=torch.arange(shared, len(prompt), device=device).view(1, -1),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return Stitched(logits=out.logits[0].float(), cache=cache, next_position=len(prompt), recomputed_tokens=0)

    def _batch(self, prefills: Sequence[Stitched]) -> PaddedBatch:
        return PaddedBatch.of_prefills(self.kv.model, prefills, room=self.config.max_new_tokens)

    def _generate_batch(self, prefills: Sequence[Stitched]) -> list[tuple[str, list[int]]]:
        """Greedy answers of prefills (of any prompt lengths), decoded together as one batch."""
        return self._generate(self._batch(prefills)) if prefills else []

    def _generate(self, batch: PaddedBatch) -> list[tuple[str, list[int]]]:
        """Each row's greedy answer, up to its first line break or EOS: the text, and the tokens (the stopping
        token included) that the teacher-forced passes then force."""
        logits = batch.last_logits
        tokens: list[list[int]] = [[] for _ in range(batch.size)]
        done = [False] * batch.size
        active, live = batch, list(range(batch.size))  # the rows still decoding, and the row of each in `batch`
        for step in range(self.config.max_new_tokens):
            picks = logits.argmax(-1)
            for b, token in zip(live, picks.tolist()):
                if not done[b]:
                    tokens[b].append(token)
                    done[b] = token in self.stop_ids
            if all(done) or step + 1 == self.config.max_new_tokens:
                break
            going = [i for i, b in enumerate(live) if not done[b]]
            # A step reads every row's KV: once the finished rows would cost more over the steps left than
            # copying the others out (about two steps' reading of each), go on with a copy of the rest.
            if (len(live) - len(going)) * (self.config.max_new_tokens - step - 1) > 2 * len(going):
                active, live, picks = active.subset(going, step), [live[i] for i in going], picks[going]
            with self.kv.lock:
                logits = active.forward(picks.view(-1, 1), step)[:, -1]
        batch.reset()
        return [
            (self.kv.tokenizer.decode([t for t in ts if t not in self.stop_ids], skip_special_tokens=True).strip(), ts)
            for ts in tokens
        ]

    def _forced(self, batch: PaddedBatch, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
        """Teacher forcing, all rows in one forward: per row, [1 + len(sequence), V] logits (the prefill's last
        row, then one row per forced token)."""
        width = max(map(len, sequences))
        rows = [batch.last_logits[b : b + 1] for b in range(batch.size)]
        if not width:
            return rows
        padded = [s + [s[-1] if s else 0] * (width - len(s)) for s in sequences]  # after each row's end: unread
        with self.kv.lock:
            logits = batch.forward(torch.tensor(padded, device=batch.device), 0)
        batch.reset()
        return [torch.cat([rows[b], logits[b, : len(s)]]) for b, s in enumerate(sequences)]

    def _target_distance(
        self,
        stitched: Stitched,
        ref: Reference,
        question: str,
        ids: list[list[int]],
        order: list[int],
        target: int,
    ) -> float | None:
        """||target KV - its full-prefill KV|| / ||full-prefill KV||, keys and values of every layer together
        (None when the plan left the target out of the prompt)."""
        if target not in order:
            return None
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

    def _model(self, lead: bool) -> KVModel:
        """The study's model, or the same model encoding chunks behind the neutral lead."""
        if not lead:
            return self.kv
        if self._lead_kv is None:
            self._lead_kv = self.kv.with_lead(DEFAULT_LEAD)
        return self._lead_kv

    def _chunk_kv(self, texts: list[str], model: KVModel | None = None) -> list[ChunkKV]:
        model = model or self.kv
        keys = [(model.encoder_id, t) for t in texts]
        missing = [k for k in dict.fromkeys(keys) if k not in self._kv_cache]
        if missing:
            for key, chunk in zip(missing, model.encode([t for _, t in missing])):
                self._kv_cache[key] = chunk
        for key in keys:
            self._kv_cache.move_to_end(key)
        while len(self._kv_cache) > 400:  # about 2 GB of fp32 KV on the default model
            self._kv_cache.popitem(last=False)
        return [self._kv_cache[k] for k in keys]

    def _scores(self, question: str, texts: list[str]) -> list[float]:
        missing = [t for t in dict.fromkeys(texts) if t not in self._vectors]
        if missing:
            for text, vector in zip(missing, torch.as_tensor(self.embedder.embed(missing))):
                self._vectors[text] = vector
        while len(self._vectors) > 20_000:
            self._vectors.popitem(last=False)
        q = torch.as_tensor(self.embedder.embed([question]))[0]
        return [float(self._vectors[t] @ q) for t in texts]
