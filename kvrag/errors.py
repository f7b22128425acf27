"""Typed errors of kvrag. Each message says what was wrong and what to do about it.

This module owns the exception hierarchy only; it never decides when to raise.
"""

from __future__ import annotations


class KVRAGError(Exception):
    """Base class of every error kvrag raises on purpose.

    Its message is shown with control characters escaped (`printable`): a question or a path given by a user
    cannot move a terminal's cursor, recolour it or end the line when the message is printed.
    """

    def __str__(self) -> str:
        return printable(super().__str__())


class UnsupportedModelError(KVRAGError):
    """The model's position scheme cannot be re-positioned by a rotation, so reuse would be wrong."""


class ModelNotFoundError(KVRAGError):
    """The model id or folder could not be loaded (missing files, no network)."""


class EmptyInputError(KVRAGError, ValueError):
    """A text, chunk list or question was empty or whitespace only."""


class NoMatchError(EmptyInputError):
    """Retrieval found no chunk for the question (the filters match none). Adapters answer `NO_CONTEXT` instead."""


class ContextOverflowError(KVRAGError, ValueError):
    """A chunk or a stitched prompt does not fit in the model's context window."""


class InvalidRequestError(KVRAGError, ValueError):
    """An argument is outside what kvrag accepts (unknown strategy, bad target, bad sampling value)."""


class LayoutError(KVRAGError):
    """The prompt template cannot be split into prefix, context and suffix."""


class StoreError(KVRAGError):
    """A KV store could not be read or written (disk full, permissions, Redis unreachable)."""


class DocumentError(KVRAGError, ValueError):
    """A document could not be read (missing, unreadable, not UTF-8, unsupported type)."""


class IndexLoadError(KVRAGError):
    """An index folder is missing, damaged, or was built with another model or embedder."""


class LockTimeoutError(KVRAGError):
    """An index folder's lock was held by another process for longer than the caller would wait."""


class BusyError(KVRAGError):
    """The engine already has its bound of queries in flight (`max_in_flight`); retry later or raise the bound."""


def type_name(value: object) -> str:
    """How an error names what it was given: `int`, or the full class of anything not built in
    (`llama_index.core.schema.Document`), so an object of another framework is named unambiguously."""
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# Every C0 control, DEL and the C1 controls: what a terminal acts on instead of showing.
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)]}


def printable(text: str) -> str:
    """`text` with every control character written as an escape (`\\x1b`), so it prints as the one line it is."""
    return text.translate(_CONTROL)
