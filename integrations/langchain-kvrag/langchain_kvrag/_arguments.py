"""What the components here share: the check of their keyword arguments before pydantic sees them, and how a
component over an index folder is serialized (its configuration, its engine reopened from the folder)."""

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


class OpenedFromIndex:
    """Serialization of a component whose engine (`engine`, excluded from dumps) was opened from `index`, a folder:
    `dumpd`/`dumps` and pickling carry the configuration and the folder, and loading reopens the engine there. An
    engine without a folder cannot be carried: `to_json` says it is not implemented and pickling says why."""

    def to_json(self) -> Any:
        if self.index is None:  # type: ignore[attr-defined]  # an in-memory engine: nothing on disk to reopen
            return self.to_json_not_implemented()  # type: ignore[attr-defined]
        return super().to_json()  # type: ignore[misc]

    def __reduce__(self) -> Any:
        if self.index is None:  # type: ignore[attr-defined]
            raise TypeError(
                f"a {type(self).__name__} over an engine without a folder cannot be pickled (its index and KV live "
                "in this process only): build the engine with a path, KVRAG.from_defaults(path), and pickling "
                "reopens it there"
            )
        config = self.model_dump(exclude={"engine"}, exclude_unset=True)  # type: ignore[attr-defined]
        return (_reopen, (type(self), config | {"index": self.index}))  # type: ignore[attr-defined]

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.model_copy()  # type: ignore[attr-defined]  # the engine is shared, never copied


def _reopen(cls: type, config: dict[str, Any]) -> Any:
    """Unpickling: the component's configuration, its engine reopened from the index folder."""
    return cls(**config)
