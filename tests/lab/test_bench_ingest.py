"""The ingest section of `kvrag bench` and `kvrag bench-ingest` on a tiny model folder: every row timed in interleaved
rounds, and the line that says ingestion's ratio to the raw batched forward.

Structure only: speed figures live in docs/performance.md, never in assertions.
"""

import pytest
from tiny import HashEmbedder, save_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model"))


def test_the_ingest_section_times_every_row_in_rounds_and_says_the_ratio_to_the_raw_forward(model):
    from kvrag.lab.bench.ttft import ingest_benchmark
    from kvrag.model.kvmodel import KVModel

    kv = KVModel.from_pretrained(str(model))
    lines = []
    texts = [f"Chunk {i} is about the harbour, the mill and the river, number {i}." * (1 + i % 3) for i in range(6)]
    result = ingest_benchmark(kv, texts=texts, runs=2, embedder=HashEmbedder(), print_fn=lines.append)
    names = {"raw batched forward", "kvrag encode_chunks", "kvrag encode in context", "ingest, memory store"}
    names.add("ingest, memory + disk (float16)")  # a model kvrag does not name: a new index stores float16
    assert set(result["x_raw"]) == names and all(len(t) == 2 for t in result["runs_s"].values())
    assert result["x_raw"]["raw batched forward"] == 1.0
    assert lines[-1].startswith("ingestion at ") and "x (memory store)" in lines[-1]
