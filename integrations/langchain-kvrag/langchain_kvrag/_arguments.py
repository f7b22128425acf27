"""The one check every component here runs on its keyword arguments before pydantic sees them."""

from __future__ import annotations

from typing import Any

from kvrag import InvalidRequestError
from pydantic import BaseModel


def refuse_unknown(cls: type[BaseModel], base: type[BaseModel], kwargs: dict[str, Any], also: str = "") -> None:
    """Raise kvrag's error naming the unknown keywords and the component's own fields (those `base` lacks).

    Checked before pydantic so that the mistake reaches the user as `InvalidRequestError`, not wrapped in a
    ValidationError.
    """
    unknown = sorted(set(kwargs) - set(cls.model_fields))
    if unknown:
        ours = [name for name in cls.model_fields if name not in base.model_fields]
        raise InvalidRequestError(
            f"unknown argument(s) {', '.join(unknown)}: {cls.__name__} takes {', '.join(ours)}{also}"
        )
