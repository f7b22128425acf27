"""Load: hundreds of queries from several threads against one engine, with a memory store bounded below the
corpus (so entries are evicted and read back from disk all along): no error, the memory bound kept, no
growth of the process, and every answer identical to a serial run's."""

import threading
import time

from tiny import HashEmbedder, byte_tokenizer, tiny_model

from kvrag import Answer, KVModel
from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
from kvrag.engine.rag import KVRAG

THREADS, QUERIES_PER_THREAD = 6, 50
PLACES = [f"Tarn{i}" for i in range(30)]
FACTS = [f"The harbour of {p} holds {3 + i} ships and its keeper is named Keeper{i}." for i, p in enumerate(PLACES)]
QUESTIONS = [f"How many ships does {p} hold?" for p in PLACES]


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_many_threads_answer_as_a_serial_run_within_the_memory_bound(tmp_path):
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    one_chunk = kv.encode([FACTS[0]])[0].nbytes
    front = MemoryStore(max_bytes=8 * one_chunk)  # a quarter of the corpus: evictions all the time
    rag = KVRAG(kv, embedder=HashEmbedder(), store=TieredStore(front, DiskStore(tmp_path / "kv")))
    rag.ingest(FACTS, progress=False)
    options = {"top_k": 3, "max_new_tokens": 4}
    serial = {q: rag.query(q, **options).token_ids for q in QUESTIONS}
    assert len(set(map(tuple, serial.values()))) > 1  # answers differ by question: a mix-up would show

    errors, mismatches, over_bound = [], [], []
    baseline = rss_bytes()
    peak = [baseline]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], rss_bytes())
            if front.nbytes > front.max_bytes:
                over_bound.append(front.nbytes)
            time.sleep(0.01)

    def worker(t):
        try:
            for n in range(QUERIES_PER_THREAD):
                q = QUESTIONS[(t * 7 + n) % len(QUESTIONS)]
                if n % 5 == 0:  # some streams too: the pieces, then the answer
                    *pieces, answer = list(rag.stream(q, **options))
                    assert isinstance(answer, Answer) and "".join(pieces) == answer.text
                else:
                    answer = rag.query(q, **options)
                if answer.token_ids != serial[q]:
                    mismatches.append((q, answer.token_ids))
        except Exception as err:  # noqa: BLE001 -- every failure is reported below
            errors.append(repr(err))

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    seconds = time.perf_counter() - started

    assert errors == [] and mismatches == [] and over_bound == []
    assert front.nbytes <= front.max_bytes and len(rag.store.back) == len(FACTS)
    # Memory: the store is bounded at 8 chunks (a few hundred KB); the process may not grow by more than
    # allocator noise over 300 queries.
    assert peak[0] - baseline < 64 << 20, (peak[0] - baseline) >> 20
    assert THREADS * QUERIES_PER_THREAD == 300 and seconds < 120
