"""Sub-questions by kvrag's splitter, for LlamaIndex's SubQuestionQueryEngine:
`from llama_index.question_gen.kvrag import KVRAGQuestionGenerator`."""

from llama_index.question_gen.kvrag.base import KVRAGQuestionGenerator

__all__ = ["KVRAGQuestionGenerator"]
