"""Chunk KV: its type and its one key (kv.py), how a request's chunks become KV (chunks.py), its stored form
(codec.py) and the stores that keep it (store/)."""
