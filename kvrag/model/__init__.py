"""The model: `KVModel` (kvmodel.py), loading and the architecture check (loading.py), the named models and their
offline conversion (catalog.py), the prompt layout (layout.py), chunk encoding (encode.py) and re-positioning of
cached keys (rope.py)."""
