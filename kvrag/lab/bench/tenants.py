"""What a tenant learns about another's stored texts from a shared store: hits and time.

    python -m kvrag.lab.bench.tenants [--texts 12] [--rounds 3]

Two engines share one disk store under one namespace label, each with its own key. Tenant A stores the KV of
`--texts` bundled API entries; tenant B, who knows the label, then answers over each of them and over as many
entries nobody stored, alternately, and counts its store hits and times its first tokens. Keyed (the default):
B gets no hit and the two medians match, so B cannot tell which texts A stored. The same probe with both tenants
unkeyed (`--no-secret` indexes) is the control: there B's hits and faster first tokens reveal A's texts. On the
embedded default model; it never runs beside other measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from importlib import resources
from typing import Any

from kvrag.cache.store import DiskStore
from kvrag.engine.embed import Embedder
from kvrag.engine.rag import KVRAG
from kvrag.kvmodel import KVModel

QUESTION = "What does this function return?"


def entries(n: int) -> list[str]:
    """The first `n` bundled API entries' texts."""
    folder = resources.files("kvrag") / "data" / "python_docs"
    lines = (folder / "api_entries.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()][:n]


def probe(
    kv: KVModel,
    embedder: Any,
    *,
    texts: int = 12,
    rounds: int = 3,
    keyed: bool = True,
    corpus: list[str] | None = None,
) -> dict[str, Any]:
    """B's hits and median first token over A's stored texts and over unstored ones (see the module docstring);
    `corpus`: 2 x `texts` texts instead of the bundled entries."""
    corpus = corpus or entries(2 * texts)
    stored, unseen = corpus[:texts], corpus[texts:]
    with tempfile.TemporaryDirectory() as root:
        def tenant(secret: bytes) -> KVRAG:
            return KVRAG(kv, embedder=embedder, store=DiskStore(root), namespace="team", secret=secret)

        a = tenant(b"tenant A's key, 32 bytes long...." if keyed else b"")
        b = tenant(b"tenant B's key, 32 bytes long...." if keyed else b"")
        a.store_kv(stored)
        times: dict[str, list[float]] = {"stored": [], "unseen": []}
        hits = {"stored": 0, "unseen": 0}
        for _ in range(rounds):
            for s, u in zip(stored, unseen):
                for name, text in (("stored", s), ("unseen", u)):
                    if keyed or name == "unseen":  # B's own copy from a round before goes (unkeyed, A's is B's)
                        b.store.delete(b.source.key(kv.chunk_ids(0, text)))
                    answer = b.answer(QUESTION, [text], strategy="reuse", max_new_tokens=1)
                    times[name].append(answer.stats.ttft_s)
                    hits[name] += answer.stats.store_hits
    stored_s, unseen_s = statistics.median(times["stored"]), statistics.median(times["unseen"])
    return {
        "keyed": keyed,
        "texts": texts,
        "rounds": rounds,
        "hits_on_stored": hits["stored"],
        "hits_on_unseen": hits["unseen"],
        "ttft_stored_s": stored_s,
        "ttft_unseen_s": unseen_s,
        "ratio": stored_s / unseen_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    kv, embedder = KVModel.from_pretrained(), Embedder()
    for keyed in (True, False):
        r = probe(kv, embedder, texts=args.texts, rounds=args.rounds, keyed=keyed)
        print(
            f"{'keyed  ' if keyed else 'unkeyed'}: B's hits on A's {r['texts']} texts {r['hits_on_stored']} of "
            f"{r['texts'] * r['rounds']} (on unseen texts {r['hits_on_unseen']}); first token "
            f"{r['ttft_stored_s']:.3f} s on A's texts against {r['ttft_unseen_s']:.3f} s on unseen ones, ratio "
            f"{r['ratio']:.2f}"
        )


if __name__ == "__main__":
    main()
