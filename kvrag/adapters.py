"""What a framework adapter needs from kvrag beside the engine: the checks of a request's arguments, made before
the framework's own validation so that a mistake reaches the user as kvrag's error, and small helpers. The
LlamaIndex and LangChain integrations import these names from here only; anything deeper is kvrag's own.
"""

from typing import Any, Mapping

from kvrag.answer import last_answer
from kvrag.engine.aio import in_thread, to_thread
from kvrag.engine.embed import Embedder
from kvrag.engine.index import check_filters, check_top_k
from kvrag.errors import type_name
from kvrag.model.loading import DEFAULT_MODEL_NAME, EMBEDDED_WEIGHTS
from kvrag.plan.parts import split
from kvrag.plan.request import SAMPLING_FIELDS, check_options, scores_of
from kvrag.plan.sampling import DRAFT_TOKENS

__all__ = [
    "DEFAULT_MODEL_NAME",
    "answered_by",
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


def answered_by(answer: Mapping[str, Any]) -> dict[str, Any]:
    """What every surface reports beside an answer's text, from its `Answer.to_dict()` form: the ids of the chunks
    a prompt that answered held (`read`; the other sources were only retrieved), the plan that ran and why
    (`plan`, `reason`: empty when the caller named the plan) and whether the answer abstained."""
    stats = answer["stats"]
    return {
        "read": [s["id"] for s in answer["sources"] if s.get("read")],
        "plan": stats["strategy"],
        "reason": stats.get("reason", ""),
        "abstained": bool(answer.get("abstained", False)),
    }
