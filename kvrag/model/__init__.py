"""The model runtime: one model made ready for chunk KV (runtime.py: layout, prefix KV, encoding set-up, chunk
keys, prompt ids, lock), loading and the architecture check (loading.py), the named models and their offline
conversion (catalog.py), the prompt layout (layout.py), chunk encoding (encode.py), re-positioning of cached keys
(rope.py), and the forwards over a stitched cache (recompute.py, stitched.py) or a padded batch (batch.py).
`KVModel`, the facade over it, is `kvrag.kvmodel` (kvmodel.py here is its old path)."""
