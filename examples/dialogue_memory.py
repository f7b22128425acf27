"""A dialogue-memory assistant: every past session of a chat is one stored chunk, and questions about the
user are answered over the retrieved sessions' reused KV.

    python examples/dialogue_memory.py              # 12 sessions, 13 questions (about 55 s on 2 cores)
    python examples/dialogue_memory.py --quick      # 4 sessions, 2 questions (about 20 s)

The conversation is a controlled synthetic world (`kvrag.lab.synthetic.dialogue`): facts about the user and
the people they mention are stated in some sessions and updated in later ones, so the session that holds
the answer (the target) competes with older values and with the same kind of fact about other people.
Each session is ingested once as one chunk (embedded, KV encoded and kept in memory). Each question
retrieves the top sessions and is answered with target recompute (the retriever's top session moved next
to the question and recomputed against the reused KV of the others) and with full prefill over the same
sessions, printing both answers, their time to first token and whether each is right.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvrag import KVRAG, Document, KVModel, MemoryStore
from kvrag.engine.embed import Embedder
from kvrag.lab.synthetic import dialogue

STRATEGIES = ("target_recompute", "full_prefill")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 sessions and 2 questions (for tests)")
    parser.add_argument("--sessions", type=int, default=12, help="sessions in the conversation")
    parser.add_argument("--questions", type=int, default=None, help="questions asked (default: all)")
    parser.add_argument("--top-k", type=int, default=4, help="sessions retrieved for each question")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic conversation")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--model", default=None, help="Hugging Face id or folder (default: embedded SmolLM2)")
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.questions = 4, 2
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    kv = KVModel.from_pretrained(args.model)
    rag = KVRAG(kv, embedder=Embedder(), store=MemoryStore())
    print(f"model and embedder loaded in {time.perf_counter() - t0:.1f} s; {torch.get_num_threads()} threads")

    sessions, questions = dialogue(seed=args.seed, sessions=args.sessions)
    questions = questions[: args.questions]
    stats = rag.ingest(
        [Document(s.text, {"session": n}, id=s.id) for n, s in enumerate(sessions)], split=False, progress=False
    )
    print(
        f"ingested {stats.chunks} sessions ({stats.tokens} tokens): KV encoded in {stats.encode_s:.1f} s; "
        f"{len(questions)} questions, top {args.top_k} sessions each\n"
    )

    right = {s: 0 for s in STRATEGIES}
    ttft: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    top_is_target = 0
    for n, q in enumerate(questions, 1):
        print(f"Q{n} [{q.family}] {q.question}  (expected: {q.answers[0]}, stated last in {q.target})")
        for strategy in STRATEGIES:
            answer = rag.query(
                q.question, strategy=strategy, top_k=args.top_k, max_new_tokens=args.max_new_tokens, stop=["\n\n"]
            )
            if strategy == STRATEGIES[0]:
                retrieved = [s.id.split("#")[0] for s in answer.sources]
                top_is_target += retrieved[0] == q.target
                print(f"    retrieved {' '.join(retrieved)}; the top one is the target: {retrieved[0] == q.target}")
            text = " ".join(answer.text.split())
            ok = any(a.lower() in text.lower() for a in q.answers)
            right[strategy] += ok
            ttft[strategy].append(answer.stats.ttft_s)
            print(f"    {strategy:<17} ttft {answer.stats.ttft_s:6.3f} s  {'right' if ok else 'wrong'}  | {text}")
        print()

    print(f"retriever's top session was the target in {top_is_target} of {len(questions)}")
    for strategy in STRATEGIES:
        print(
            f"{strategy:<17} right {right[strategy]} of {len(questions)}, "
            f"median ttft {statistics.median(ttft[strategy]):.3f} s"
        )
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
