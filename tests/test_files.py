"""One file-mode policy: every file kvrag writes into an index folder and its disk store is 0600 and every folder
it makes 0700, whatever the umask (the documents' text is as private as their KV)."""

import os
import stat

import pytest
from tiny import FACTS, HashEmbedder

from kvrag.cache.store import DiskStore, MemoryStore, TieredStore
from kvrag.engine.folder import IndexFolder
from kvrag.engine.rag import KVRAG
from kvrag.plan.defaults import save_default

pytestmark = pytest.mark.usefixtures("hash_embedder")


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o000])
def test_every_file_kvrag_writes_is_private_whatever_the_umask(kv, tmp_path, umask):
    old = os.umask(umask)
    try:
        index = tmp_path / "index"
        store = TieredStore(MemoryStore(), DiskStore(IndexFolder(index).kv_folder()))
        rag = KVRAG(kv, embedder=HashEmbedder(), store=store, path=index)
        rag.ingest(FACTS, progress=False)
        rag.persist()
        save_default(index, {"strategy": "reuse"})
    finally:
        os.umask(old)
    files = [p for p in index.rglob("*") if p.is_file()]
    folders = [index, *(p for p in index.rglob("*") if p.is_dir())]
    names = {p.name.split("-")[0] for p in files}
    assert {"kvrag", ".kvrag.lock", "chunks", "vectors"} <= names and any(p.suffix == ".safetensors" for p in files)
    assert [p for p in files if stat.S_IMODE(p.stat().st_mode) != 0o600] == []
    assert [p for p in folders if stat.S_IMODE(p.stat().st_mode) != 0o700] == []
