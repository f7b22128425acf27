"""What differs between the transformers releases kvrag runs on, in one place.

transformers renamed a forward's `past_key_values` argument to `cache` (the old name warns from 5.2x and
is removed in 5.40); serving stacks pin older releases (vLLM 0.32 pins transformers < 5.20). This module
never runs the model.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _cache_argument(model_class: type) -> str:
    params = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that hands `cache` to this model's forward: `{"cache": cache}` where it takes one."""
    return {_cache_argument(type(model)): cache}


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's RoPE settings as one flat dict (transformers 5 `rope_parameters`)."""
    params = getattr(config, "rope_parameters", None) or {}
    return dict(params)
