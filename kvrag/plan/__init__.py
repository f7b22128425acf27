"""Deciding: what a request asks (request.py), which chunk is the target (pickers.py), where each chunk goes and
which tokens are recomputed (strategies.py), checked once (planner.py); the measurements a plan may ask of the
model (probe.py), the shipped defaults (defaults.py) and questions answered a part at a time (parts.py).
Nothing here runs a model's forward except through the probe it is handed."""
