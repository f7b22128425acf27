"""The real default model (SmolLM2-135M-Instruct from the embedded GGUF), offline.

Prints its figures: run with `-s` to see them.
"""

import random

import pytest
import torch

from kvrag import KVModel
from kvrag.cache.kv import ChunkKV
from kvrag.lab.demo import run_demo, sample_docs
from kvrag.model.encode import stacked_kv
from kvrag.plan.strategies import BUILTIN_STRATEGIES
from kvrag.model.recompute import full_prefill, recompute

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    # A fresh cache folder: every run converts the embedded GGUF to safetensors, as a new user's first run does.
    cache = tmp_path_factory.mktemp("kvrag-cache")
    model = KVModel.from_pretrained(cache_dir=cache)
    meta = next((cache / "models").glob("*/kvrag.json"))
    assert model.fingerprint.weights.startswith("gguf:") and model.fingerprint.weights in meta.read_text()
    return model


@pytest.fixture(scope="module")
def docs():
    return sample_docs()


def test_full_prefill_greedy_equals_model_generate(kv, docs):
    chunks, items = docs
    texts = [c["text"] for c in chunks[:4]]
    a = kv.answer(items[0]["question"], texts, strategy="full_prefill", max_new_tokens=24)
    ids = kv.prompt_ids(items[0]["question"], [kv.layout.chunk_ids(t) for t in texts], range(4))
    with torch.inference_mode():
        out = kv.model.generate(
            torch.tensor([ids]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=kv.eos_ids,
            pad_token_id=kv.tokenizer.pad_token_id,
        )
    expected = [t for t in out[0, len(ids) :].tolist() if t not in kv.eos_ids]
    print(f"\nfull_prefill: {a.text!r}")
    assert a.token_ids == expected and len(expected) > 3


def test_mechanism_is_exact_on_the_real_model(kv, docs):
    chunks, items = docs
    ids = [kv.layout.chunk_ids(c["text"]) for c in chunks[:3]]
    suffix = kv.layout.suffix_ids(items[0]["question"])
    one = kv.encode([chunks[0]["text"]])
    got = recompute(kv.model, kv.repositioner, kv.prefix, one, [0], {}, suffix, logits_to_keep=len(suffix))
    ref = full_prefill(kv.model, kv.layout.prefix_ids + ids[0] + suffix, logits_to_keep=len(suffix))
    one_chunk = (got.logits - ref.logits).abs().max().item()
    # middle chunk recomputed, the others' KV taken from a full prefill
    full_ids = kv.layout.prefix_ids + ids[0] + ids[1] + ids[2] + suffix
    ref3 = full_prefill(kv.model, full_ids, logits_to_keep=len(suffix))
    P, exact = len(kv.prefix), []
    for part in ids:
        k, v = stacked_kv(ref3.cache, 0, P, P + len(part))
        exact.append(ChunkKV(torch.tensor(part), k, v, start=P))
        P += len(part)
    got3 = recompute(
        kv.model,
        kv.repositioner,
        kv.prefix,
        exact,
        [0, 1, 2],
        {1: torch.arange(len(ids[1]))},
        suffix,
        logits_to_keep=len(suffix),
    )
    middle = (got3.logits - ref3.logits).abs().max().item()
    scale = ref3.logits.abs().max().item()
    print(
        f"\nmax |logit diff| vs full prefill (logits up to {scale:.1f}): one chunk {one_chunk:.2e}, "
        f"middle chunk recomputed {middle:.2e}"
    )
    assert one_chunk < 1e-3 and middle < 1e-3


def first_token_kl(reference, other):
    p = torch.log_softmax(reference, -1)
    return torch.sum(p.exp() * (p - torch.log_softmax(other, -1))).item()


def test_target_recompute_is_closer_to_full_prefill_than_reuse(kv, docs):
    chunks, items = docs
    rng = random.Random(0)
    rows = []
    for item in items[:3]:
        target = next(i for i, c in enumerate(chunks) if c["id"] == item["target"])
        for size in (3, 6, 10):
            others = rng.sample([i for i in range(len(chunks)) if i != target], size - 1)
            at = rng.randrange(0, size - 1)  # never last: the target's place matters
            picked = others[:at] + [target] + others[at:]
            texts = [chunks[i]["text"] for i in picked]
            enc = kv.encode(texts)
            q = item["question"]
            reuse = kv.prefill(q, enc, strategy="reuse").prefill.logits[-1]
            run = kv.prefill(q, enc, strategy="target_recompute", target=at)
            given = kv.prefill(q, texts, strategy="full_prefill").prefill.logits[-1]
            moved = full_prefill(
                kv.model, kv.prompt_ids(q, [c.token_ids.tolist() for c in enc], run.decision.plan.order)
            )
            tr = run.prefill.logits[-1]
            reuse_kl, tr_kl, tr_given = (
                first_token_kl(given, reuse),
                first_token_kl(moved.logits[-1], tr),
                first_token_kl(given, tr),
            )
            rows.append((item["target"], size, at, reuse_kl, tr_kl, tr_given))
    print("\nfirst-token KL against full prefill (target_recompute: in its own order / in the given order)")
    print(f"{'target':<12}{'chunks':>7}{'at':>4}{'reuse':>10}{'t_recomp':>10}{'(given)':>10}")
    for t, size, at, r, tr, trg in rows:
        print(f"{t:<12}{size:>7}{at:>4}{r:>10.4f}{tr:>10.4f}{trg:>10.4f}")
    mean_reuse = sum(r[3] for r in rows) / len(rows)
    mean_tr = sum(r[4] for r in rows) / len(rows)
    wins = sum(r[4] < r[3] for r in rows)
    print(
        f"mean: reuse {mean_reuse:.4f}, target_recompute {mean_tr:.4f}; target_recompute closer in {wins}/{len(rows)}"
    )
    assert mean_tr < mean_reuse
    assert wins > len(rows) / 2


def test_demo_runs_and_retrieves_the_targets(kv, capsys):
    records = run_demo(kv, questions=3, max_new_tokens=32)
    out = capsys.readouterr().out
    print(out)
    assert len(records) == 12 and out.count("retriever's top chunk") == 3
    assert out.count("holds the answer: True") == 6  # the retriever's top chunk and the default's pick, each time
    shipped = [r for r in records if r["strategy"] == "target_only"]  # the embedded model's default
    assert len(shipped) == 3 and all(r["order"] == [r["target"]] and r["recomputed_tokens"] == 0 for r in shipped)
    assert all(r["picker"] == "gap" and r["target"] in range(3) for r in shipped)  # one of the best three
    assert out.count("target_only:gap (default)") == 3
    tr = [r for r in records if r["strategy"] == "target_recompute"]
    assert all(r["recomputed_tokens"] > 0 and r["order"][-1] == r["target"] == 0 for r in tr)
    # every chunk was stored at ingestion; a query reads only the chunks its plan reuses (none for full prefill)
    assert all(r["chunks_encoded"] == 0 for r in records)
    # (the default's gap picker reads the retriever's pick alone where its lead is clear, else the three candidates
    # its likelihood pass scores)
    def read(r):
        if r["strategy"] == "target_only":
            return 3 if any(w.startswith("question likelihood") for w in r["extra_work"]) else 1
        return 0 if r["strategy"] == "full_prefill" else len(r["order"])

    assert all(r["store_hits"] == read(r) for r in records)
    assert sum(r["right"] for r in tr) >= 2


STUDY = BUILTIN_STRATEGIES


def test_strategy_table_on_the_real_model(kv, docs):
    """Every strategy on a handful of examples: first-token KL against full prefill, recomputed share, prefill time."""
    import time

    chunks, items = docs
    rng = random.Random(1)
    rows = {name: [] for name in STUDY}
    for item in items[:3]:
        target = next(i for i, c in enumerate(chunks) if c["id"] == item["target"])
        others = rng.sample([i for i in range(len(chunks)) if i != target], 5)
        at = rng.randrange(0, 5)
        picked = others[:at] + [target] + others[at:]
        enc = kv.encode([chunks[i]["text"] for i in picked])
        q = item["question"]
        scores = [1.0 if i == at else 0.5 for i in range(len(picked))]
        given = kv.prefill(q, enc, strategy="full_prefill").prefill.logits[-1]
        references = {}  # full prefill in each order a strategy used
        for name in STUDY:
            t0 = time.perf_counter()
            run = kv.prefill(
                q,
                enc,
                strategy=name,
                scores=scores,
                target=at,
                budget=0.05,
                picker="retriever" if name != "attention_select" else None,
            )
            seconds = time.perf_counter() - t0
            order = tuple(run.decision.plan.order)
            if order not in references:
                ids = kv.prompt_ids(q, [c.token_ids.tolist() for c in enc], order)
                references[order] = full_prefill(kv.model, ids).logits[-1]
            logits = run.prefill.logits[-1]
            rows[name].append(
                dict(
                    kl=first_token_kl(given, logits),
                    kl_own=first_token_kl(references[order], logits),
                    frac=run.prefill.recomputed_tokens / run.context_tokens,
                    s=seconds,
                    budget=run.decision.budget_tokens,
                    rec=run.prefill.recomputed_tokens,
                    extra=run.probe.extra_token_layers,
                    picked=run.decision.target,
                )
            )
    mean = lambda name, key: sum(r[key] for r in rows[name]) / len(rows[name])  # noqa: E731
    print("\nmeans over 3 examples of 6 chunks, budget 0.05; KL of the first-token distribution against full prefill")
    print("strategy          KL(given)  KL(own order)  recomputed  prefill s  extra token-layers  picked")
    for name in STUDY:
        picks = [r["picked"] for r in rows[name]]
        print(
            f"{name:<17}{mean(name, 'kl'):>10.4f}{mean(name, 'kl_own'):>15.4f}{mean(name, 'frac'):>12.1%}"
            f"{mean(name, 's'):>11.3f}{mean(name, 'extra'):>20.0f}  {picks}"
        )
    assert mean("full_prefill", "kl") < 1e-9 and mean("reuse", "frac") == 0 and mean("reorder", "frac") == 0
    for name in ("spread", "spread_chunks", "token_select"):
        assert all(r["rec"] <= r["budget"] for r in rows[name])
    assert mean("full_prefill", "kl_own") < 1e-9 and mean("target_recompute", "frac") > 0
    assert mean("token_select", "extra") > 0 and mean("insert_full_kv", "extra") > 0


def test_the_c_step_and_the_compiled_step_give_the_torch_steps_answers(kv, docs):
    from kvrag.cpu import ckernel
    from kvrag.cpu.decode import compile_decoding, native_decoding

    chunks, items = docs
    texts = [c["text"] for c in chunks[:4]]
    questions = [item["question"] for item in items[:3]]

    def answers():
        return [kv.answer(q, texts, strategy="target_recompute", max_new_tokens=24).text for q in questions]

    native = answers()  # the default: the C step where it built
    assert native_decoding(kv.model, False) == ckernel.available()
    try:
        eager = answers()
        assert compile_decoding(kv.model)
        compiled = answers()
    finally:
        compile_decoding(kv.model, enabled=False)  # the module's other tests decode as by default
        native_decoding(kv.model, True)
    assert compiled == eager == native and all(len(a) > 20 for a in eager)


def test_a_header_given_by_name_is_the_layouts_and_keys_its_own_chunks(kv):
    from kvrag.errors import InvalidRequestError
    from kvrag.model.layout import CONTEXT_HEADER, DECLINING_HEADER, PromptLayout

    declining = KVModel(kv.model, kv.tokenizer, layout=PromptLayout(kv.tokenizer, header=DECLINING_HEADER))
    by_name = KVModel.from_pretrained(header=DECLINING_HEADER)
    assert kv.layout.header == CONTEXT_HEADER and by_name.layout.header == DECLINING_HEADER
    assert by_name.layout.prefix_ids == declining.layout.prefix_ids != kv.layout.prefix_ids
    assert by_name.encoder_id == declining.encoder_id != kv.encoder_id  # chunks under one header miss under another
    with pytest.raises(InvalidRequestError, match="header= or layout="):
        KVModel.from_pretrained(header=DECLINING_HEADER, layout=kv.layout)
