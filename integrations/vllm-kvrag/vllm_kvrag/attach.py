"""`attach`: one call that puts a kvrag engine's plans on vLLM, over the engine's own store.

    rag = attach(KVRAG.load("./index"))            # an in-process vllm.LLM with kvrag's connector
    rag = attach(KVRAG.load("./index"), server="http://vllm-host:8000")   # a `vllm serve` that loads it

Retrieval, picking and planning stay in the engine; the forward and decoding run in vLLM. The connector reads
the same store the engine writes (its disk folder or its Redis, the tenant's view of it), so ingestion
stores each chunk's KV once for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvrag.cache.store import DiskStore, KVStore, RedisStore, TieredStore, without_credentials
from kvrag.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvrag.engine.rag import KVRAG


def store_config(store: KVStore, *, namespace: str = "", password_file: str | None = None) -> dict[str, Any]:
    """The connector's extra config that reads `store` (a disk folder or Redis, behind any memory front).

    vLLM writes this config to its log, so it never holds a password: a Redis that needs one is given
    `password_file`, a file holding it, for the connector to read. Its TLS files are passed as they were given.
    """
    while isinstance(store, TieredStore):
        store = store.back
    if store.view:  # a tenant's view: the connector opens the whole store and takes the same view of it
        namespace, store = store.view, store.legacy or store
    if isinstance(store, DiskStore):
        config: dict[str, Any] = {"store": "disk", "path": str(store.root), "storage_dtype": store.storage_dtype}
    elif isinstance(store, RedisStore):
        if store.has_password and not password_file:
            raise InvalidRequestError(
                "this engine's Redis needs a password, and vLLM writes its connector's config to its log: pass "
                "password_file=, a file holding the password, for the connector to read it from there"
            )
        config = {
            "store": "redis",
            "url": without_credentials(store._raw_url),
            "namespace": store.namespace,
            "storage_dtype": store.storage_dtype,
            **store.tls,
        }
        if password_file:
            config["password_file"] = str(password_file)
    else:
        raise InvalidRequestError(
            f"vLLM's connector reads a disk folder or Redis; this engine keeps its KV in a {type(store).__name__}: "
            "give the engine a DiskStore or a RedisStore (behind a MemoryStore if you like)"
        )
    if namespace:
        config["tenant"] = namespace
    return config


def attach(
    rag: KVRAG,
    llm: Any = None,
    *,
    server: str | None = None,
    secret_file: str | None = None,
    password_file: str | None = None,
    memory_bytes: int = 0,
    **llm_options: Any,
) -> KVRAG:
    """Run `rag`'s plans on vLLM from now on; return `rag`.

    Args:
        rag: the engine (its index, store, model and tenant stay as they are).
        llm: a `vllm.LLM` already made with `kv_transfer_config=connector_config(store_config(rag.store))`;
            by default one is started here, over the engine's model, with `llm_options` passed to `vllm.LLM`.
        server: the URL of a `vllm serve` that loads kvrag's connector over the same store (then no vLLM is
            started here, and only httpx is needed).
        secret_file: for an engine keyed with a secret other than the user's kvrag key, a file holding it, for the
            connector to read.
        password_file: for an engine whose Redis needs a password, a file holding it, for the connector to read.
        memory_bytes: the connector's memory tier (decoded entries kept in vLLM's worker).
    """
    from kvrag.cache.secret import user_key, user_key_path
    from vllm_kvrag.executor import VLLMExecutor, connector_config

    default_key = bool(rag.secret) and user_key_path().is_file() and rag.secret == user_key()  # the connector's too
    if rag.secret and not default_key and not secret_file and server is None and llm is None:
        raise InvalidRequestError(
            "this engine checksums its entries under a tenant secret: pass secret_file=, a file holding the same "
            "secret, so vLLM's connector can verify them"
        )
    if server is not None:
        from vllm_kvrag.server import VLLMServerExecutor

        rag.executor = VLLMServerExecutor(rag.kvmodel, server, rag.store, rag.namespace, secret=rag.secret)
        return rag
    if llm is None:
        from vllm import LLM

        from kvrag.model.catalog import resolve

        extra = store_config(rag.store, namespace=rag.namespace, password_file=password_file)
        if secret_file:
            extra["secret_file"] = str(secret_file)
        elif not rag.secret:
            extra["unkeyed"] = True
        if memory_bytes:
            extra["memory_bytes"] = int(memory_bytes)
        model = resolve(rag.model_source)  # a named model's converted folder; None: the embedded default's
        options = {"block_size": 32, "dtype": str(rag.kvmodel.model.dtype).removeprefix("torch."), **llm_options}
        llm = LLM(model=model, kv_transfer_config=connector_config(extra), **options)
    rag.executor = VLLMExecutor(rag.kvmodel, llm, rag.store, rag.namespace, secret=rag.secret)
    return rag
