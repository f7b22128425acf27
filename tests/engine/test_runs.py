"""Retrieved chunks read with their run (`kvrag.engine.runs`): a run that two retrieved chunks share is given whole, in
document order, where the index encoded its chunks in their document's context; nothing changes where it did not."""

import pytest
from tiny import byte_tokenizer, tiny_model

from kvrag.cache.store import MemoryStore
from kvrag.engine.embed import Embedder
from kvrag.engine.index import ChunkIndex, ChunkRecord
from kvrag.engine.rag import KVRAG
from kvrag.engine.runs import with_runs
from kvrag.kvmodel import KVModel

RUNS = {"a": ["a0", "a1", "a2", "a3"], "b": ["b0", "b1"], "c": ["c0"]}
RUN_OF = {c: run for run in RUNS.values() for c in run}


def test_a_run_two_hits_share_is_given_whole_in_place_of_its_best_hit():
    given = with_runs(["a2", "c0", "a0", "b1"], RUN_OF.__getitem__, lambda c: 10)
    assert given == ["a0", "a1", "a2", "a3", "c0", "b1"]  # b met once: its hit alone


def test_a_run_that_would_pass_the_token_bound_keeps_its_hits():
    hits = ["b0", "a2", "a0", "b1"]
    assert with_runs(hits, RUN_OF.__getitem__, lambda c: 10, most=50) == ["b0", "b1", "a2", "a0"]  # b: +0, a: +20
    assert with_runs(hits, RUN_OF.__getitem__, lambda c: 10, most=60) == ["b0", "b1", "a0", "a1", "a2", "a3"]


def test_the_index_finds_a_run_from_how_each_chunk_was_encoded():
    index = ChunkIndex(4)
    afters = [0, 1, 2, 0, 1]  # two runs of one document: 0-2 and 3-4
    records = [ChunkRecord(id=f"d#{n}", doc_id="d", text=str(n), after=a) for n, a in enumerate(afters)]
    records.append(ChunkRecord(id="e#0", doc_id="e", text="e"))
    index.add(records, __import__("numpy").eye(4, dtype="float32")[[0, 1, 2, 3, 0, 1]])
    assert [r.id for r in index.run_of(records[1])] == ["d#0", "d#1", "d#2"]
    assert [r.id for r in index.run_of(records[3])] == ["d#3", "d#4"]
    assert [r.id for r in index.run_of(records[5])] == ["e#0"]
    alone = ChunkIndex(4)
    alone.add([ChunkRecord(id=f"d#{n}", doc_id="d", text=str(n)) for n in range(3)], __import__("numpy").eye(4)[:3])
    assert [r.id for r in alone.run_of(alone.records["d#1"])] == ["d#1"]  # encoded alone: a run of one


STORY = (
    "The lighthouse of Karsa was built in 1872 by Mira Holt. Its lamp burned whale oil until 1910. Orin Dask "
    "keeps the keys of the lighthouse. The river Tam floods every spring. The old mill of Brenn grinds rye."
)
OTHER = "Plums ripen in August in the valley of Osk. The ferry to Lume leaves at dawn."


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama", seed=41), byte_tokenizer(), decode_weights="model")


@pytest.mark.parametrize("encoding", ["document", "alone"])
def test_retrieval_gives_the_run_of_two_hits_whole_where_chunks_were_encoded_in_context(kv, encoding):
    rag = KVRAG(kv, embedder=Embedder(), store=MemoryStore(), chunk_tokens=60, overlap=0, encoding=encoding)
    rag.ingest([STORY, OTHER], progress=False)
    story = sorted((r for r in rag.index.records.values() if r.text in STORY), key=lambda r: int(r.id.split("#")[1]))
    assert len(story) >= 4
    other = len(rag.index.records) - len(story)
    top_k = other + 2  # two of the story's chunks at least among them
    hits = rag.retrieve("Who keeps the keys of the lighthouse of Karsa?", top_k=top_k, whole_runs=False)
    runs = rag.retrieve("Who keeps the keys of the lighthouse of Karsa?", top_k=top_k, whole_runs=True)
    if encoding == "alone":
        assert [s.id for s in runs] == [s.id for s in hits] and all(s.retrieved for s in runs)
        return
    assert len(hits) < len(runs)
    ids = [s.id for s in runs]
    assert [i for i in ids if i in {r.id for r in story}] == [r.id for r in story]  # the story whole, in order
    assert {s.id for s in runs if s.retrieved} == {s.id for s in hits}
    by_id = {s.id: s for s in hits}
    for source in runs:
        if source.retrieved:
            assert source.score == by_id[source.id].score
        else:  # its dense similarity, below every retrieved chunk's
            assert source.score <= min(s.score for s in hits) + 1e-6
    assert [s.id for s in rag.retrieve("Who keeps the keys of the lighthouse of Karsa?", top_k=top_k)] == ids  # default
    answer = rag.query("Who keeps the keys of the lighthouse of Karsa?", top_k=top_k, max_new_tokens=4)
    assert [s.id for s in answer.sources] == ids and answer.stats.chunks_encoded == 0
    alone = rag.query("Who keeps the keys of the lighthouse of Karsa?", top_k=top_k, whole_runs=False, max_new_tokens=4)
    assert [s.id for s in alone.sources] == [s.id for s in hits]
