"""kvrag.cache.codec.stored_form: what a store's `as_stored` gives (KV exactly as a read would return it) is
`decode_entry(encode_entry(...))` bit for bit, in every storage and model dtype, with no tensor shared."""

import pytest
import torch

from kvrag.cache.codec import STORAGE_DTYPES, decode_entry, encode_entry, stored_form
from kvrag.cache.kv import ChunkKV
from kvrag.cache.store import DiskStore, MemoryStore, TieredStore

ENC = "encoder-1"


def chunk(dtype: torch.dtype) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    keys = 8 * torch.randn(3, 2, 7, 4, generator=g)  # [L, H_kv, T, D]
    values = torch.randn(3, 2, 7, 6, generator=g)  # [L, H_kv, T, D_v]: another head size for int4's values
    return ChunkKV(torch.arange(7) + 100, keys.to(dtype), values.to(dtype), 5, ENC)


@pytest.mark.parametrize("storage", list(STORAGE_DTYPES))
@pytest.mark.parametrize("model", [torch.float32, torch.bfloat16, torch.float16])
def test_the_stored_form_is_what_a_read_returns(storage, model):
    c = chunk(model)
    read = decode_entry(encode_entry(c, key="k", dtype=storage), key="k", encoder=ENC, dtype=model, device="cpu")
    got = stored_form(c, dtype=storage)
    for name in ("token_ids", "keys", "values"):
        a, b = getattr(got, name), getattr(read, name)
        assert a.dtype == b.dtype and a.is_contiguous() == b.is_contiguous() and torch.equal(a, b), name
        assert a.untyped_storage().data_ptr() != getattr(c, name).untyped_storage().data_ptr(), name  # a copy
    assert (got.start, got.encoder) == (read.start, read.encoder) == (5, ENC)


def test_a_tiered_store_holds_in_front_what_its_back_reads(tmp_path):
    c = chunk(torch.bfloat16)
    store = TieredStore(MemoryStore(), DiskStore(tmp_path / "kv"))
    store.bind(encoder=ENC, dtype=torch.bfloat16, device="cpu")
    store.put("a" * 64, c)
    front, back = store.front.get("a" * 64), store.back.get("a" * 64)
    assert torch.equal(front.keys, back.keys) and torch.equal(front.values, back.values)
    assert torch.equal(store.as_stored(c).keys, back.keys)
