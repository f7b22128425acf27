import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(min(2, torch.get_num_threads()))


import pytest  # noqa: E402


@pytest.fixture
def hash_embedder(monkeypatch):
    """kvrag.engine.rag's Embedder replaced by tiny.HashEmbedder: engines built in the test load no embedding model.
    A module uses it with `pytestmark = pytest.mark.usefixtures("hash_embedder")` (or defines its own)."""
    from tiny import HashEmbedder

    monkeypatch.setattr("kvrag.engine.rag.Embedder", HashEmbedder)


@pytest.fixture(scope="module")
def kv():
    """A tiny random llama behind kvrag's KVModel (a module may define its own `kv` instead)."""
    from tiny import byte_tokenizer, tiny_model

    from kvrag import KVModel

    return KVModel(tiny_model("llama"), byte_tokenizer())


def pytest_terminal_summary(terminalreporter):
    """Said at the end of the run, where a newcomer reads: without redis-server the Redis store tests were skipped."""
    import shutil

    if shutil.which("redis-server") is None:
        terminalreporter.write_line(
            "kvrag: the Redis store tests were skipped: redis-server is not installed "
            "(`make test` installs Debian's when run as root with apt-get; else `apt-get install redis-server`)",
            yellow=True,
        )
