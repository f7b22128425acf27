"""A new index stores and encodes its chunks' KV as its model's catalog entry chose (k4v3 entries for the 0.5B and the
1.5B, float16 for any other model; chunks alone for the 135M, in their document's context for any other) unless told
otherwise; an existing index keeps its own; Redis entries of the CLI follow the same."""

import argparse
import json

import pytest
from tiny import byte_tokenizer, tiny_model

from kvrag.cli.common import store_of
from kvrag.engine.folder import MANIFEST
from kvrag.engine.rag import KVRAG
from kvrag.errors import InvalidRequestError
from kvrag.kvmodel import KVModel
from kvrag.model import catalog


def test_the_catalog_names_each_models_storage_dtype():
    assert catalog.shipped_storage_dtype(catalog.QWEN_05B.weights) == "k4v3"
    assert catalog.shipped_storage_dtype(catalog.QWEN_15B.weights) == "k4v3"
    assert catalog.shipped_storage_dtype(catalog.SMOLLM2_135M.weights) == "float16"
    assert catalog.shipped_storage_dtype("hub:someone/else@main") == "float16"


def test_a_new_index_stores_as_its_model_chose_and_an_existing_one_keeps_its_own(tmp_path):
    named = KVModel(tiny_model("qwen2", seed=61), byte_tokenizer(), weights_id=catalog.QWEN_05B.weights,
                    decode_weights="model")
    rag = KVRAG.from_defaults(tmp_path / "named", model=named, chunk_tokens=60, overlap=0, secret="")
    rag.ingest(["Orin Dask keeps the keys of the lighthouse of Karsa."], progress=False)
    manifest = json.loads((tmp_path / "named" / MANIFEST).read_text())
    assert rag.info()["storage_dtype"] == manifest["storage_dtype"] == "k4v3"
    int4 = KVRAG.from_defaults(tmp_path / "int4", model=named, storage_dtype="int4", chunk_tokens=60, overlap=0,
                               secret="")
    int4.ingest(["Orin Dask keeps the keys of the lighthouse of Karsa."], progress=False)
    assert KVRAG.from_defaults(tmp_path / "int4", model=named, secret="").info()["storage_dtype"] == "int4"  # kept
    told = KVRAG.from_defaults(tmp_path / "told", model=named, storage_dtype="float16", chunk_tokens=60, overlap=0,
                               secret="")
    told.ingest(["The river Tam floods every spring."], progress=False)
    again = KVRAG.from_defaults(tmp_path / "told", model=named, secret="")  # the index's own, not the model's
    assert told.store.back.storage_dtype == again.store.back.storage_dtype == "float16"
    other = KVModel(tiny_model("qwen2", seed=62), byte_tokenizer(), decode_weights="model")
    assert KVRAG.from_defaults(tmp_path / "other", model=other, secret="").store.back.storage_dtype == "float16"
    with pytest.raises(InvalidRequestError, match="unknown storage dtype 'int3'"):
        KVRAG.from_defaults(tmp_path / "bad", model="no-such-model", storage_dtype="int3")
    assert not (tmp_path / "bad").exists()


def test_the_clis_redis_store_writes_the_index_s_dtype_else_the_flag_else_the_models_choice():
    args = argparse.Namespace(redis="redis://127.0.0.1:1/0", model="qwen2.5-coder-0.5b", storage_dtype=None)
    assert store_of(args).back.storage_dtype == "k4v3"
    assert store_of(argparse.Namespace(**{**vars(args), "model": "/a/folder"})).back.storage_dtype == "float16"
    assert store_of(argparse.Namespace(**{**vars(args), "storage_dtype": "int8"})).back.storage_dtype == "int8"
    assert store_of(args, storage_dtype="bfloat16").back.storage_dtype == "bfloat16"


def test_a_new_engine_encodes_as_its_model_chose_unless_told():
    from kvrag.cache.store import MemoryStore
    from kvrag.engine.embed import Embedder

    embedder = Embedder()

    assert catalog.shipped_encoding(catalog.SMOLLM2_135M.weights) == "alone"
    assert catalog.shipped_encoding(catalog.QWEN_05B.weights) == catalog.shipped_encoding("hub:x/y@main") == "document"
    small = KVModel(tiny_model("llama", seed=63), byte_tokenizer(), weights_id=catalog.SMOLLM2_135M.weights,
                    decode_weights="model")
    assert KVRAG(small, embedder=embedder, store=MemoryStore()).encoding == "alone"
    assert KVRAG(small, embedder=embedder, store=MemoryStore(), encoding="document").encoding == "document"
    other = KVModel(tiny_model("llama", seed=64), byte_tokenizer(), decode_weights="model")
    assert KVRAG(other, embedder=embedder, store=MemoryStore()).encoding == "document"


def test_a_new_index_asks_under_its_models_header_and_an_existing_one_keeps_its_own(tmp_path):
    from kvrag.model.layout import CONTEXT_HEADER, DECLINING_HEADER

    assert catalog.shipped_header(catalog.QWEN_15B.weights) == DECLINING_HEADER
    assert catalog.shipped_header(catalog.QWEN_05B.weights) == catalog.shipped_header("hub:x/y@main") == CONTEXT_HEADER
    large = KVModel(tiny_model("qwen2", seed=65), byte_tokenizer(), weights_id=catalog.QWEN_15B.weights,
                    decode_weights="model")
    assert large.layout.header == DECLINING_HEADER
    rag = KVRAG.from_defaults(tmp_path / "large", model=large, chunk_tokens=60, overlap=0, secret="")
    rag.ingest(["Orin Dask keeps the keys of the lighthouse of Karsa."], progress=False)
    assert json.loads((tmp_path / "large" / MANIFEST).read_text())["header"] == DECLINING_HEADER
    # an index built before headers (its manifest names none) was encoded under kvrag's own, and answers under it
    plain = large.with_header(CONTEXT_HEADER)
    assert plain.model is large.model and plain.encoder_id != large.encoder_id
    old = KVRAG.from_defaults(tmp_path / "old", model=plain, chunk_tokens=60, overlap=0, secret="")
    old.ingest(["The river Tam floods every spring."], progress=False)
    manifest = json.loads((tmp_path / "old" / MANIFEST).read_text())
    del manifest["header"]
    (tmp_path / "old" / MANIFEST).write_text(json.dumps(manifest))
    opened = KVRAG.load(tmp_path / "old", model=large, secret=b"")
    assert opened.kvmodel.layout.header == CONTEXT_HEADER and opened.kvmodel.encoder_id == plain.encoder_id
    answer = opened.query("When does the river Tam flood?", max_new_tokens=2)
    assert answer.stats.store_hits >= 1 and answer.stats.chunks_encoded == 0  # its stored KV read, none re-encoded
    assert KVRAG.load(tmp_path / "large", model=large, secret=b"").kvmodel is large  # the same header: the same model
