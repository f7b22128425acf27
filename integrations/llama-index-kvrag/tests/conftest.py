import os
import sys

import pytest

# The tiny random models and byte tokenizer of the core test suite.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))

from tiny import save_tiny  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny llama and the byte tokenizer as a model folder (what `model=` of KVRAG.from_defaults takes)."""
    return save_tiny(tmp_path_factory.mktemp("li-model") / "model")


@pytest.fixture(scope="session")
def embedder():
    """kvrag's default embedder, loaded once for the session."""
    from kvrag.engine.embed import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def embed_model(embedder):
    from llama_index.embeddings.kvrag import KVRAGEmbedding

    return KVRAGEmbedding(embedder)


@pytest.fixture
def events():
    """What LlamaIndex's root instrumentation dispatcher emits during the test (the handler is removed after)."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    seen: list = []

    class Recorder(BaseEventHandler):
        @classmethod
        def class_name(cls) -> str:
            return "Recorder"

        def handle(self, event, **kwargs) -> None:
            seen.append(event)

    root = get_dispatcher()
    handler = Recorder()
    root.add_event_handler(handler)
    try:
        yield seen
    finally:
        root.event_handlers.remove(handler)
