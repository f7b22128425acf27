"""kvrag's model as a LlamaIndex chat LLM: `from llama_index.llms.kvrag import KVRAGLLM`."""

from llama_index.llms.kvrag.base import KVRAGLLM

__all__ = ["KVRAGLLM"]
