"""vllm-kvrag: kvrag's plans served by vLLM, through kvrag's own KV connector.

- `vllm_kvrag.connector.KVRAGConnector`: loaded by vLLM (`kv_connector_module_path="vllm_kvrag.connector"`);
  fills a planned prompt's head with kvrag's stored chunk KV, re-positioned.
- `vllm_kvrag.executor.VLLMExecutor`: kvrag's executor over a `vllm.LLM`; `connector_config` makes its
  `kv_transfer_config`.
- `vllm_kvrag.attach.attach(rag)`: an engine's plans on vLLM in one call, over the engine's own store.
- `vllm_kvrag.bench`: time to first token and concurrent throughput against vLLM's own prefill
  (`kvrag bench-vllm`).
"""

from vllm_kvrag.plan import Piece, TransferPlan

__all__ = ["Piece", "TransferPlan"]
