"""KV stores behind one small interface: memory (LRU bounded in bytes), disk, Redis, and tiers of them, a module
each.

A store maps a chunk key (`kvrag.cache.kv.chunk_key`) to a ChunkKV. Disk and Redis keep `kvrag.cache.codec` entries
(safetensors with a checksum); what cannot be read back safely is a miss. Stores never encode chunks
and never decide what to recompute.
"""

from kvrag.cache.store.base import NAMESPACE, KVStore, SerializedStore, StoreWarning, check_namespace
from kvrag.cache.store.disk import DiskStore
from kvrag.cache.store.memory import MemoryStore
from kvrag.cache.store.redis_store import RedisStore
from kvrag.cache.store.tiered import TieredStore
from kvrag.cache.store.urls import has_credentials, redact, without_credentials

__all__ = [
    "NAMESPACE",
    "DiskStore",
    "KVStore",
    "MemoryStore",
    "RedisStore",
    "SerializedStore",
    "StoreWarning",
    "TieredStore",
    "check_namespace",
    "has_credentials",
    "redact",
    "without_credentials",
]
