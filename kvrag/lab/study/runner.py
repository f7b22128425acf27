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
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kvrag.cache.chunks import ChunkSource
from kvrag.cache.store import MemoryStore
from kvrag.errors import ContextOverflowError, InvalidRequestError
from kvrag.lab.study.cache import RECORDS, REFERENCES, Appender, digest, read_jsonl
from kvrag.lab.study.data import StudyItem
from kvrag.kvmodel import DEFAULT_LEAD, KVModel
from kvrag.model.batch import PaddedBatch

from kvrag.lab.study.item import ItemRun
from kvrag.lab.study.rows import Row, StudyConfig

CHUNK_KV_BYTES = 2 << 30  # chunk KV kept between items (chunks recur across a built-in set's items)


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
        run = ItemRun(self, item)
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

