"""Executing: one request from chunks to an Answer (pipeline.py) through the executor seam (executor.py), the one
primitive that recomputes a token set against a stitched cache (recompute.py), decoding (generate.py) and batches
of prompts (batch.py)."""
