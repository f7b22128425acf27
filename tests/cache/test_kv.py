"""kvrag.cache.kv: the ChunkKV type checks its own shapes; the chunk key and encoder id separate everything a chunk's
KV depends on."""

import pytest
import torch

from kvrag.cache.kv import ChunkKV, chunk_key, encoder_id


def chunk(t=4, layers=2, heads=3, dim=5):
    return ChunkKV(torch.arange(t), torch.randn(layers, heads, t, dim), torch.randn(layers, heads, t, dim), start=7)


def test_chunk_key_separates_model_prefix_chunk_and_salt():
    k = chunk_key("m1", [1, 2], [3, 4])
    assert k == chunk_key("m1", [1, 2], [3, 4])
    others = {
        chunk_key("m2", [1, 2], [3, 4]),
        chunk_key("m1", [1], [2, 3, 4]),
        chunk_key("m1", [1, 2], [3]),
        chunk_key("m1", [1, 2], [3, 4], salt="tenant-a"),
    }
    assert len(others | {k}) == 5


def test_the_encoder_id_depends_on_the_model_and_the_prefix():
    assert encoder_id("m", [1, 2]) == encoder_id("m", [1, 2])
    assert len({encoder_id("m", [1, 2]), encoder_id("m", [1]), encoder_id("n", [1, 2])}) == 3


def test_inconsistent_shapes_are_refused():
    with pytest.raises(ValueError, match="inconsistent chunk KV"):
        ChunkKV(torch.arange(3), torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5), start=0)
    with pytest.raises(ValueError, match="inconsistent chunk KV"):
        ChunkKV(torch.arange(4), torch.randn(2, 3, 4, 5), torch.randn(2, 2, 4, 5), start=0)


def test_to_casts_keys_and_values_and_keeps_ids_and_position():
    c = chunk()
    half = c.to(dtype=torch.float16)
    assert half.keys.dtype == half.values.dtype == torch.float16 and half.token_ids.dtype == torch.int64
    assert len(half) == 4 and half.start == 7 and half.nbytes == c.nbytes // 2


def test_a_chunk_encoded_in_context_has_a_key_of_its_own_and_alone_keeps_the_old_one():
    alone = chunk_key("m", [1, 2], [3, 4])
    assert chunk_key("m", [1, 2], [3, 4], context=()) == alone
    assert chunk_key("m", [1, 2], [3, 4], context=[5]) not in (alone, chunk_key("m", [1, 2], [3, 4], context=[6]))
    # the context is its own field: ids moved from the chunk into the context make another key
    assert chunk_key("m", [1, 2], [4], context=[3]) != chunk_key("m", [1, 2], [3, 4])
