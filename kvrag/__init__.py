"""kvrag: reuse attention (KV) state in retrieval-augmented generation.

Every chunk is encoded once and its KV kept; a query stitches the stored KV of its chunks, re-positioned
by one RoPE rotation, repairs what matters most (by default: the target chunk, moved next to the question
and recomputed against the reused cache) and generates.
"""

import logging

from kvrag.answer import NO_CONTEXT, Answer, AnswerStats, Source
from kvrag.cache.chunks import Chunks, ChunkSource
from kvrag.cache.kv import ChunkKV, chunk_key
from kvrag.cache.store import DiskStore, KVStore, MemoryStore, RedisStore, TieredStore
from kvrag.engine.documents import Document, register_loader
from kvrag.engine.rag import KVRAG, IngestStats
from kvrag.errors import (
    ContextOverflowError,
    DocumentError,
    EmptyInputError,
    IndexLoadError,
    InvalidRequestError,
    KVRAGError,
    LayoutError,
    ModelNotFoundError,
    NoMatchError,
    StoreError,
    UnsupportedModelError,
)
from kvrag.kvmodel import KVModel
from kvrag.model.layout import PromptLayout
from kvrag.model.loading import SUPPORTED_MODEL_TYPES, ModelFingerprint, check_architecture
from kvrag.plan.pickers import PICKERS
from kvrag.plan.planner import Decision
from kvrag.plan.probe import Probe
from kvrag.plan.request import Request
from kvrag.plan.strategies import STRATEGIES, Plan, PlanRequest, register_strategy
from kvrag.run.executor import Executor, HFExecutor, Job
from kvrag.run.pipeline import Prefilled

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())  # kvrag logs; the application decides where it goes

__all__ = [
    "NO_CONTEXT",
    "NoMatchError",
    "Answer",
    "AnswerStats",
    "check_architecture",
    "chunk_key",
    "ChunkKV",
    "Chunks",
    "ChunkSource",
    "ContextOverflowError",
    "Decision",
    "DiskStore",
    "Document",
    "DocumentError",
    "EmptyInputError",
    "Executor",
    "HFExecutor",
    "IndexLoadError",
    "IngestStats",
    "Job",
    "InvalidRequestError",
    "KVModel",
    "KVRAG",
    "KVRAGError",
    "KVStore",
    "LayoutError",
    "MemoryStore",
    "ModelFingerprint",
    "ModelNotFoundError",
    "PICKERS",
    "Plan",
    "PlanRequest",
    "Prefilled",
    "Probe",
    "PromptLayout",
    "RedisStore",
    "register_loader",
    "register_strategy",
    "Request",
    "Source",
    "StoreError",
    "STRATEGIES",
    "SUPPORTED_MODEL_TYPES",
    "TieredStore",
    "UnsupportedModelError",
]
