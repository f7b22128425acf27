"""One study item's work: its references (closed book, full prefill in every order a row used) and its rows,
decoded and teacher-forced together; a record for each row."""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

import torch

from kvrag.errors import ContextOverflowError
from kvrag.kvmodel import KVModel
from kvrag.lab.study.cache import Appender, digest
from kvrag.lab.study.data import StudyItem
from kvrag.lab.study.metrics import kl_topk, kv_distance, log_likelihood, normalize, token_f1, topk_logprobs
from kvrag.lab.study.rows import REFERENCE_FIELDS, Reference, Row, StudyConfig, common_prefix, keeping_probe, order_name
from kvrag.model.batch import PaddedBatch
from kvrag.model.recompute import Prefill, full_prefill
from kvrag.plan.request import Request
from kvrag.plan.sampling import Sampling
from kvrag.run.pipeline import Prefilled


class Runner(Protocol):
    """What an item's work reads of the study's runner (`kvrag.lab.study.runner.StudyRunner`)."""

    kv: KVModel
    config: StudyConfig
    references: dict[str, dict[str, Any]]

    def item_key(self, item: StudyItem) -> str: ...
    def model(self, lead: bool) -> KVModel: ...
    def chunk_kv(self, texts: list[str], model: KVModel) -> list: ...
    def scores(self, question: str, texts: list[str]) -> list[float]: ...
    def generate(self, batch: PaddedBatch) -> list[tuple[str, list[int]]]: ...


class ItemRun:
    """One item's work: its references (closed book, full prefill in every order a row used) and its rows,
    decoded and teacher-forced together."""

    def __init__(self, runner: Runner, item: StudyItem) -> None:
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
        name = order_name(order)
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
            ((common_prefix(prompt, i), c) for i, c in self.sources), key=lambda s: s[0], default=(0, None)
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
        return model, model.with_default(request)

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
        closed, base = self.refs["closed"], self.refs[order_name(self.given)]
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
        from kvrag.run.parts import answer_parts
        from kvrag.run.pipeline import stream

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
                scores_of=lambda question: self.runner.scores(question, self.texts), named_picker=row.picker,
            )
            answers = answer.parts
        text = " ".join(answer.text.split())
        base = self.refs[order_name(self.given)]
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
            own += [self.refs[order_name(pre.decision.plan.order)] for pre, _ in runs]
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
        base = self.refs[order_name(self.given)]
        order = list(pre.decision.plan.order)
        ref = self.refs[order_name(order)]
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
