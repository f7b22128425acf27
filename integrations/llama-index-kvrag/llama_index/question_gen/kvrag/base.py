"""kvrag's built-in splitter as a LlamaIndex question generator.

`SubQuestionQueryEngine` asks a question generator for sub-questions, answers each through a tool and composes the
answers with its LLM. Stock generators ask an LLM for JSON, which a small local model rarely writes well; this one
splits the question with kvrag's splitter (`kvrag.plan.parts.split`: two questions joined by "and", one attribute of
each of several things, a comparison of two things), with no model call. With a `KVRAGQueryEngine` as the tool,
every sub-question reads the stored KV of the chunks it retrieves, so the parts share one set of stored chunks.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from llama_index.core.prompts.mixin import PromptDictType, PromptMixinType
from llama_index.core.question_gen.types import BaseQuestionGenerator, SubQuestion
from llama_index.core.schema import QueryBundle
from llama_index.core.tools.types import ToolMetadata

from kvrag import InvalidRequestError
from kvrag.adapters import split


class KVRAGQuestionGenerator(BaseQuestionGenerator):
    """Sub-questions from kvrag's splitter, every one sent to one tool.

    Args:
        tool_name: the tool each sub-question goes to; default: the only tool the engine has (refused when it has
            several and none is named).

    A question the splitter cannot split is one sub-question, the question itself. A bridge ("What is the birth
    year of the founder of X?") needs the first part's answer before the second is asked, which
    `SubQuestionQueryEngine` does not do: it too is one sub-question (`KVRAG.query(question, parts="auto")` asks it
    as a hop).
    """

    def __init__(self, tool_name: Optional[str] = None) -> None:
        if tool_name is not None and (not isinstance(tool_name, str) or not tool_name.strip()):
            raise InvalidRequestError(f"tool_name is {tool_name!r}: give a tool's name, or None for the only tool")
        self.tool_name = tool_name

    def _get_prompts(self) -> PromptDictType:
        return {}  # no prompt: the splitter is code

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if prompts:
            raise InvalidRequestError(
                f"KVRAGQuestionGenerator has no prompts to update (got {', '.join(prompts)}): it splits in code"
            )

    def _get_prompt_modules(self) -> PromptMixinType:
        return {}

    def _tool(self, tools: Sequence[ToolMetadata]) -> str:
        names = [t.name for t in tools]
        if self.tool_name is not None:
            if self.tool_name not in names:
                raise InvalidRequestError(
                    f"tool_name {self.tool_name!r} is not one of the engine's tools ({', '.join(map(repr, names))})"
                )
            return self.tool_name
        if len(names) != 1:
            raise InvalidRequestError(
                f"the engine has {len(names)} tools ({', '.join(map(repr, names))}): name the one kvrag's "
                "sub-questions go to, KVRAGQuestionGenerator(tool_name=...)"
            )
        return str(names[0])

    def generate(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> List[SubQuestion]:
        name = self._tool(tools)
        parts = split(query.query_str)
        if parts is None or any(p.hop for p in parts):
            return [SubQuestion(sub_question=query.query_str, tool_name=name)]
        return [SubQuestion(sub_question=p.question, tool_name=name) for p in parts]

    async def agenerate(self, tools: Sequence[ToolMetadata], query: QueryBundle) -> List[SubQuestion]:
        return self.generate(tools, query)
