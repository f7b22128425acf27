"""Prompt layout: the prefix, each chunk and the suffix as token ids, from the model's own chat template.

The stitched prompt is prefix ids + chunk ids (each chunk tokenized alone, no BOS inside) + suffix ids;
full prefill runs on exactly these ids, so reuse and full prefill see the same tokens. This module never
touches the model.
"""

from __future__ import annotations

import array
from typing import Any, Mapping, Sequence

from kvrag.errors import EmptyInputError, InvalidRequestError, LayoutError

CONTEXT_HEADER = "Answer the question using the documents below.\n\n"
# A header that asks the model to decline in kvrag's words where the documents are silent (an answer that starts with
# them is `Answer.abstained`): the 1.5B's by default (`NamedModel.header`; it gained answers on both held-out halves),
# not the 0.5B's (it declined chats it answered right; docs/study.md); `KVModel.from_pretrained(..., header=...)`.
DECLINING_HEADER = (
    'Answer the question using the documents below. If they do not hold the answer, say "The documents do not say."'
    "\n\n"
)
# the headers by the names the CLI takes (`kvrag ingest --header`, `kvrag bench-answers --header`)
HEADERS = {"plain": CONTEXT_HEADER, "declining": DECLINING_HEADER}
QUESTION_TEMPLATE = "Question: {question}\nAnswer:"
CHUNK_SEPARATOR = "\n\n"
_MARK = "\u2063kvrag-context\u2063"
# Chunk texts whose ids are remembered: a RAG engine sees the same chunks query after query, and tokenizing an 8k
# context's 40 chunks again costs about 20 ms of every answer on CPU.
CHUNK_IDS_REMEMBERED = 4096


class PromptLayout:
    """Splits a chat-templated prompt into prefix / context / suffix token ids.

    Args:
        tokenizer: a Hugging Face tokenizer.
        system_prompt: an optional system message (the template's default is used when None).
        header: text at the head of the user turn, before the first chunk (part of the prefix).
        question_template: the text after the chunks; `{question}` is replaced by the question.
        use_chat_template: None picks the tokenizer's chat template when it has one, else a plain layout.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        system_prompt: str | None = None,
        header: str = CONTEXT_HEADER,
        question_template: str = QUESTION_TEMPLATE,
        use_chat_template: bool | None = None,
    ) -> None:
        if "{question}" not in question_template:
            raise LayoutError(f"question_template must contain '{{question}}', got {question_template!r}")
        self.tokenizer = tokenizer
        self._chunk_ids: dict[str, array.array[int]] = {}  # text -> ids, 8 bytes a token (a list takes 36)
        self.system_prompt = system_prompt
        self.header = header
        self.question_template = question_template
        if use_chat_template is None:
            use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat_template = use_chat_template
        prefix_text, _ = self._split("")
        self.prefix_text = prefix_text
        self.prefix_ids: list[int] = self._ids(prefix_text)
        if not self.use_chat_template:
            # A base model's prompt starts the way its tokenizer starts any text (BOS where it adds one).
            ids = list(tokenizer(prefix_text, add_special_tokens=True)["input_ids"])
            eos = getattr(tokenizer, "eos_token_id", None)
            self.prefix_ids = ids[:-1] if eos is not None and ids and ids[-1] == eos and len(ids) > 1 else ids
        if not self.prefix_ids:
            raise LayoutError(
                "the prompt prefix is empty (no BOS, no template, no header): give a non-empty header, "
                "the prefix is every chunk's attention sink"
            )

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _split(self, question: str) -> tuple[str, str]:
        tail = self.question_template.format(question=question)
        content = self.header + _MARK + tail
        if not self.use_chat_template:
            return content.split(_MARK)
        messages = [{"role": "user", "content": content}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(_MARK) != 1:
            raise LayoutError(
                "the chat template does not render the user message verbatim; pass use_chat_template=False"
            )
        head, rest = rendered.split(_MARK)
        return head, rest

    def chunk_ids(self, text: str) -> list[int]:
        """A chunk's ids: the stripped text plus a paragraph break, tokenized alone (no BOS)."""
        if not text or not text.strip():
            raise EmptyInputError("a chunk is empty or whitespace only: drop it or give it text")
        ids = self._chunk_ids.get(text)
        if ids is None:
            check_unicode(text, "a chunk")
            ids = array.array("q", self._ids(text.strip() + CHUNK_SEPARATOR))
            if len(self._chunk_ids) >= CHUNK_IDS_REMEMBERED:
                self._chunk_ids.clear()  # one step, safe under threads; the chunks in use come back at once
            self._chunk_ids[text] = ids
        return list(ids)

    def suffix_ids(self, question: str) -> list[int]:
        """The question template, the question, the end of the user turn and the assistant header."""
        if not question or not question.strip():
            raise EmptyInputError("the question is empty or whitespace only: ask something")
        check_unicode(question, "the question")
        head, tail = self._split(question.strip())
        if head != self.prefix_text:
            raise LayoutError("the chat template renders the text before the context differently per question")
        return self._ids(tail)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Chat messages (`{"role", "content"}`) as prompt text: the model's chat template with the assistant
        header, else one "role: content" line each and "assistant:"."""
        rendered = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        return "\n".join(f"{m['role']}: {m['content']}" for m in rendered) + "\nassistant:"

    def closed_book_ids(self, question: str) -> list[int]:
        """The question alone, no context: one user turn of the chat template, else the question template."""
        if self.use_chat_template:
            return self._ids(self.chat_prompt([{"role": "user", "content": question.strip()}]))
        return list(self.tokenizer(self.question_template.format(question=question.strip()))["input_ids"])


def check_unicode(text: str, what: str) -> str:
    """Refuse text that cannot be encoded as UTF-8: a lone surrogate, what undecodable bytes become in argv,
    file names and `errors="surrogateescape"` reads. Tokenizers fail on it with an unrelated message."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidRequestError(
            f"{what} is not valid Unicode text (a lone surrogate at character {err.start}, from bytes that are "
            "not UTF-8): decode it as UTF-8 first"
        ) from None
    return text
