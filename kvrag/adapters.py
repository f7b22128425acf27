"""What a framework adapter needs from kvrag beside the engine: the checks of a request's arguments, made before
the framework's own validation so that a mistake reaches the user as kvrag's error, and small helpers. The
LlamaIndex and LangChain integrations import these names from here only; anything deeper is kvrag's own.
"""

from kvrag.answer import last_answer
from kvrag.engine.aio import in_thread, to_thread
from kvrag.engine.embed import Embedder
from kvrag.engine.index import check_filters, check_top_k
from kvrag.errors import type_name
from kvrag.model.loading import DEFAULT_MODEL_NAME, EMBEDDED_WEIGHTS
from kvrag.plan.parts import split
from kvrag.plan.request import SAMPLING_FIELDS, check_options, scores_of
from kvrag.run.generate import DRAFT_TOKENS

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DRAFT_TOKENS",
    "EMBEDDED_WEIGHTS",
    "Embedder",
    "SAMPLING_FIELDS",
    "check_filters",
    "check_options",
    "check_top_k",
    "in_thread",
    "last_answer",
    "scores_of",
    "split",
    "to_thread",
    "type_name",
]
