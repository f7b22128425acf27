"""Deciding: what a request asks (request.py), which chunk is the target (pickers.py), where each chunk goes and
which tokens are recomputed (strategies.py), checked once (planner.py); the measurements a plan may ask of the
model (probe.py), the shipped defaults (defaults.py) and questions answered a part at a time (parts.py).
Nothing here runs a model's forward except through the probe it is handed."""

# the strategies over a subset of the chunks (the top k, a picked set) and the plan by need register from their own
# modules, after the ones `strategies` holds
from kvrag.plan import subsets  # noqa: E402,F401
from kvrag.plan import need  # noqa: E402,F401
