"""Benchmarks that print figures, side by side in one process: time to first token (ttft.py), decode, dtypes,
faults, the forward's parts, re-positioning, storage, and the report that runs them all (report.py)."""
