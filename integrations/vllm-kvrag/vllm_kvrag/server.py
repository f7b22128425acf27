"""VLLMServerExecutor: kvrag in front of a `vllm serve` server that loads kvrag's connector.

The deployment form of `VLLMExecutor`. kvrag's process retrieves, picks and plans, and stores chunk KV in the
store the server's connector reads (a shared folder or Redis). Each answer is one request to the server's
OpenAI-compatible completions endpoint, with the prompt as token ids, the transfer plan in
`kv_transfer_params` and the plan's `cache_salt`. Tokens stream back as server-sent events. This process
needs no vLLM installed, only httpx. Start the server with the command `serve_command` prints.
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any, Iterator

from kvrag.cache.store import KVStore
from kvrag.errors import StoreError
from kvrag.run.generate import Sampling
from vllm_kvrag.executor import PlannedRequests, VLLMPrefill, count_cached

if TYPE_CHECKING:
    from kvrag.kvmodel import KVModel


class VLLMServerExecutor(PlannedRequests):
    """Runs kvrag jobs on a `vllm serve` server (see the module docstring).

    Args:
        kvmodel: the kvrag model whose chunk KV is stored (the weights the server serves).
        base_url: the server, e.g. "http://127.0.0.1:8000".
        store: the store the server's connector reads.
        model: the model name the server serves (default: its only one).
        timeout: seconds to wait for the server to answer a request or to send the next token.
    """

    def __init__(
        self,
        kvmodel: KVModel,
        base_url: str,
        store: KVStore,
        namespace: str = "",
        *,
        model: str | None = None,
        timeout: float = 600.0,
        secret: bytes = b"",
    ) -> None:
        import httpx

        super().__init__(kvmodel, store, namespace, secret)
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self.client = httpx.Client(timeout=timeout)
        self.model = model or self._served_model()

    def _served_model(self) -> str:
        import httpx

        try:
            models = self.client.get(f"{self.base_url}/v1/models").json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as err:
            raise StoreError(
                f"the vLLM server at {self.base_url} does not answer /v1/models ({err}): start it"
            ) from err
        return str(models[0]["id"])

    def decode(self, prefill: VLLMPrefill, sampling: Sampling) -> Iterator[int]:  # type: ignore[override]
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prefill.prompt_ids,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},  # the last event: vLLM's cached-token count
            "return_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if prefill.plan is not None:
            body["kv_transfer_params"] = prefill.plan.to_params()
            body["cache_salt"] = prefill.plan.salt
        elif self.tenant_salt:
            body["cache_salt"] = self.tenant_salt
        with self.client.stream("POST", f"{self.base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                raise StoreError(f"the vLLM server refused the request ({response.status_code}): {response.text[:300]}")
            last: list[int] = []  # the finishing event's tokens, held until the usage event after it is read
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event.get("usage") or {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                count_cached(prefill, cached, len(self.kvmodel.prefix))
                for choice in event.get("choices", []):
                    tokens = choice.get("token_ids") or []
                    if choice.get("finish_reason"):
                        last += tokens
                    else:
                        yield from tokens
            yield from last

    def release(self, prefill: VLLMPrefill) -> None:
        return  # closing the stream ends the request on the server


def serve_command(model: str, store: dict[str, Any], *, port: int = 8000, extra: str = "") -> str:
    """The `vllm serve` command line that loads kvrag's connector over `store` (the connector's extra config).

    `--enable-prompt-tokens-details` makes the server report its cached-token count, from which each answer's
    recomputed tokens are vLLM's own count (as in-process)."""
    config = {
        "kv_connector": "KVRAGConnector",
        "kv_connector_module_path": "vllm_kvrag.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": store,
    }
    return (
        f"vllm serve {shlex.quote(model)} --port {port} --enable-prompt-tokens-details "
        f"--kv-transfer-config {shlex.quote(json.dumps(config))} {extra}"
    )
