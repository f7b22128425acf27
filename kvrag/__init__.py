"""kvrag: reuse attention (KV) state in retrieval-augmented generation.

Every chunk is encoded once and its KV kept; a query stitches the stored KV of its chunks, re-positioned
by one RoPE rotation, repairs what matters most (by default: the target chunk, moved next to the question
and recomputed against the reused cache) and generates.
"""

from kvrag.errors import (
    ContextOverflowError,
    EmptyInputError,
    InvalidRequestError,
    KVRAGError,
    LayoutError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from kvrag.kv import ChunkKV, chunk_key
from kvrag.kvmodel import Answer, AnswerStats, KVModel, Prefilled
from kvrag.layout import PromptLayout
from kvrag.model import SUPPORTED_MODEL_TYPES, ModelFingerprint, check_architecture
from kvrag.pickers import PICKERS
from kvrag.planner import Decision
from kvrag.probe import Probe
from kvrag.strategies import STRATEGIES, Plan, PlanRequest, register_strategy

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "AnswerStats",
    "ChunkKV",
    "ContextOverflowError",
    "Decision",
    "EmptyInputError",
    "InvalidRequestError",
    "KVModel",
    "KVRAGError",
    "LayoutError",
    "ModelFingerprint",
    "ModelNotFoundError",
    "PICKERS",
    "Plan",
    "PlanRequest",
    "Prefilled",
    "Probe",
    "PromptLayout",
    "STRATEGIES",
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "check_architecture",
    "chunk_key",
    "register_strategy",
]
