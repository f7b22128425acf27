"""The old path of the one primitive, kept for code that imports it from here: it lives in `kvrag.model.recompute`
(the forwards over a model are the model runtime's; run/ executes plans with them)."""

from kvrag.model.recompute import (  # noqa: F401
    GrowingLayer,
    Prefill,
    StitchedCache,
    StitchLayout,
    Workspace,
    as_cache,
    causal_mask,
    full_prefill,
    recompute,
    stitch_cache,
    stitch_layout,
    stitched_forward,
)
