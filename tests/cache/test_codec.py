"""kvrag.cache.codec: a stored entry reads back as written, and anything that cannot be trusted reads as a miss."""

import pytest
import torch

from kvrag.cache.codec import decode_entry, encode_entry
from kvrag.cache.kv import ChunkKV
from kvrag.errors import InvalidRequestError

ENC = "encoder-1"


def chunk() -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    return ChunkKV(torch.arange(6), torch.randn(2, 3, 6, 4, generator=g), torch.randn(2, 3, 6, 4, generator=g), 5, ENC)


def read(blob: bytes, key: str = "k", encoder: str = ENC) -> ChunkKV | None:
    return decode_entry(blob, key=key, encoder=encoder, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("dtype, tol", [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 1e-2), ("int8", 3e-2)])
def test_an_entry_reads_back_within_its_storage_rounding(dtype, tol):
    c = chunk()
    back = read(encode_entry(c, key="k", dtype=dtype))
    assert back is not None and torch.equal(back.token_ids, c.token_ids) and back.start == 5
    assert back.encoder == ENC and back.keys.dtype == torch.float32
    assert (back.keys - c.keys).abs().max() <= tol * c.keys.abs().max() + 1e-7
    assert (back.values - c.values).abs().max() <= tol * c.values.abs().max() + 1e-7


@pytest.mark.parametrize(
    "dtype, read_as", [("float16", torch.float16), ("bfloat16", torch.bfloat16), ("int8", torch.float32)]
)
def test_an_entry_read_as_stored_is_the_model_dtypes_reading_before_its_cast(dtype, read_as):
    """dtype=None (a reader that converts entries itself): float storage as it is, int8 dequantized to float32;
    cast to float32 it is exactly what a float32 reader gets."""
    blob = encode_entry(chunk(), key="k", dtype=dtype)
    stored = decode_entry(blob, key="k", encoder=ENC, dtype=None, device="cpu")
    assert stored is not None and stored.keys.dtype == stored.values.dtype == read_as
    assert torch.equal(stored.keys.float(), read(blob).keys) and torch.equal(stored.values.float(), read(blob).values)


def test_another_key_or_encoder_and_damaged_bytes_are_misses():
    blob = encode_entry(chunk(), key="k")
    assert read(blob, key="other") is None and read(blob, encoder="encoder-2") is None
    assert read(blob[: len(blob) // 2]) is None and read(b"") is None and read(b"\x00" * 64) is None
    for at in (len(blob) - 1, len(blob) // 2, 20):  # a tensor byte, a middle byte, a header byte
        flipped = bytearray(blob)
        flipped[at] ^= 0x01
        assert read(bytes(flipped)) is None, at


def test_an_unknown_storage_dtype_is_refused():
    with pytest.raises(InvalidRequestError, match="storage"):
        encode_entry(chunk(), key="k", dtype="float8")


@pytest.mark.parametrize("dtype", ["float16", "int4"])
def test_what_a_chunk_was_encoded_behind_is_kept_and_covered_by_the_checksum(dtype):
    from dataclasses import replace

    from kvrag.cache.codec import stored_form
    from kvrag.cache.kv import ids_digest

    c = replace(chunk(), behind=ids_digest([7, 8, 9]))
    blob = encode_entry(c, key="k", dtype=dtype)
    assert read(blob).behind == c.behind == stored_form(c, dtype=dtype).behind
    assert read(encode_entry(chunk(), key="k", dtype=dtype)).behind == ""  # encoded alone
    forged = blob.replace(c.behind.encode(), ids_digest([1]).encode())
    assert len(forged) == len(blob) and read(forged) is None
