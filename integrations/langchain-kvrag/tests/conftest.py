"""A kvrag engine on a tiny random Llama (saved to a folder) and the real default embedder, built once."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything below is local; never reach for the Hub
HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))  # langchain_kvrag, installed or not
sys.path.insert(0, str(HERE.parents[3] / "tests"))  # the core's tiny.py

import pytest  # noqa: E402
import torch  # noqa: E402
from tiny import FACTS, save_tiny  # noqa: E402

from kvrag import KVRAG  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def facts():
    """The ingested (text, metadata) pairs (a fixture: another suite's `conftest` module may share the name)."""
    return FACTS


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(folder)
    return folder


@pytest.fixture(scope="session")
def rag(model_dir, tmp_path_factory):
    """One engine for the whole session: the adapters only read it (a miss they encode is stored, as designed)."""
    root = tmp_path_factory.mktemp("kvrag")
    engine = KVRAG.from_defaults(
        root / "index", model=str(model_dir), chunk_tokens=120, overlap=8, cache_dir=root / "cache"
    )
    engine.ingest(FACTS, progress=False)
    return engine
