"""The stored form of a chunk's KV: safetensors bytes with a checksum, in a chosen storage dtype.

float32, float16 and bfloat16 keep keys and values as they are; int8 keeps a scale per channel; int4 and k4v3 keep
keys per channel and values per token in groups (`kvrag.cache.lowbit`), their layout named in the header.

Only safetensors (tensors plus a JSON header) is ever written or read back: never pickle. An entry whose
bytes are damaged, whose checksum does not match, or that was written for another model, prefix or
format version decodes to None: a miss, never a crash and never a wrong answer. This module knows
nothing of where bytes are kept.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvrag.cache import lowbit
from kvrag.cache.kv import KV_FORMAT_VERSION, ChunkKV
from kvrag.errors import InvalidRequestError

# The metadata field of the digest. Entries from before it covered the header carry "sha256" instead: a miss.
CHECKSUM = "checksum"

# A storage dtype's name and what its tensors hold (int4, k4v3: packed codes, `lowbit`). An older reader finds a name
# it does not know in an entry's header ("dtype") and misses it.
STORAGE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
    **{name: torch.uint8 for name in lowbit.FORMATS},
}


def check_storage_dtype(name: str) -> str:
    if name not in STORAGE_DTYPES:
        raise InvalidRequestError(f"unknown storage dtype '{name}': use one of {', '.join(STORAGE_DTYPES)}")
    return name


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 with one scale per channel (per layer, head and head dimension), over the chunk's tokens."""
    x = x.float()
    scale = x.abs().amax(dim=2, keepdim=True).clamp_min(1e-8) / 127.0  # [L, H, 1, D]
    return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale


def _digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str], secret: bytes = b"") -> str:
    """sha256 over every tensor (name, dtype, shape, bytes) and every metadata field but the digest itself.

    The header is covered too: a flipped dtype or shape, or a flipped `start`, would otherwise read back as
    well-formed KV at the wrong place or of the wrong kind. With a `secret` it is an HMAC-SHA256 under it: an
    entry forged by someone without the secret (another tenant with write access to the store) is a miss.
    """
    h = hmac.new(secret, digestmod=hashlib.sha256) if secret else hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy())  # the buffer itself: no copy of the bytes
    h.update(json.dumps({k: v for k, v in metadata.items() if k != CHECKSUM}, sort_keys=True).encode())
    return h.hexdigest()


def encode_entry(chunk: ChunkKV, *, key: str, dtype: str = "float16", secret: bytes = b"") -> bytes:
    """Serialize a chunk's KV for a store; keys and values in `dtype` (int8: with per-channel scales; int4, k4v3:
    keys per channel, values per token, `kvrag.cache.lowbit`).

    `secret` keys the checksum (HMAC-SHA256): only a reader with the same secret accepts the entry.
    """
    check_storage_dtype(dtype)
    tensors = _stored_tensors(chunk, dtype)
    metadata = {
        "format": str(KV_FORMAT_VERSION),
        "key": key,
        "encoder": chunk.encoder,
        "start": str(chunk.start),
        "dtype": dtype,
        **({"behind": chunk.behind} if chunk.behind else {}),
    }
    if dtype in lowbit.FORMATS:  # what lowbit.dequantize needs besides the tensors: the layout, the values' head size
        metadata.update({dtype: lowbit.FORMATS[dtype].layout, "value_dim": str(chunk.values.shape[-1])})
    metadata[CHECKSUM] = _digest(tensors, metadata, secret)
    return st_save(tensors, metadata=metadata)


def entry_metadata(blob: bytes) -> dict[str, str] | None:
    """The JSON header's metadata of a safetensors blob, or None if the header is not readable."""
    try:
        (length,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + length])
        meta = header.get("__metadata__")
        return meta if isinstance(meta, dict) else None
    except (struct.error, ValueError, UnicodeDecodeError):
        return None


def decode_entry(
    blob: bytes, *, key: str, encoder: str, dtype: torch.dtype | None, device: torch.device | str, secret: bytes = b""
) -> ChunkKV | None:
    """The ChunkKV in `blob`, in `dtype` (the model's; None: as stored, int8, int4 and k4v3 dequantized to float32) on
    `device`, or None when it must not be used.

    None means: unreadable or truncated bytes, a checksum mismatch (flipped bytes, in the tensors or in the
    header, or one not keyed with `secret`), or an entry written under another key, model/prefix (`encoder`),
    format version, storage dtype this reader does not know, or low-bit layout.
    """
    meta = entry_metadata(blob)
    if meta is None or meta.get("format") != str(KV_FORMAT_VERSION) or meta.get("key") != key:
        return None
    if meta.get("encoder") != encoder or meta.get("dtype") not in STORAGE_DTYPES:
        return None
    if meta["dtype"] in lowbit.FORMATS and meta.get(meta["dtype"]) != lowbit.FORMATS[meta["dtype"]].layout:
        return None
    try:
        tensors = st_load(blob)
    except Exception:  # safetensors raises its own error types on damaged bytes
        return None
    if not hmac.compare_digest(_digest(tensors, meta, secret), str(meta.get(CHECKSUM, ""))):
        return None
    try:
        return _read_back(tensors, meta, encoder=encoder, dtype=dtype, device=device)
    except (KeyError, ValueError, RuntimeError, IndexError):  # tensors of a checksummed but forged shape
        return None


def stored_form(chunk: ChunkKV, *, dtype: str = "float16") -> ChunkKV:
    """`chunk` exactly as `decode_entry(encode_entry(chunk, dtype=dtype))` reads it back in its own dtype and on its
    own device: the same casts and quantizers, without the serializing and the checksum (what `as_stored` needs)."""
    check_storage_dtype(dtype)
    meta = {
        "dtype": dtype,
        "start": str(chunk.start),
        "value_dim": str(chunk.values.shape[-1]),
        **({"behind": chunk.behind} if chunk.behind else {}),
    }
    back = _read_back(
        _stored_tensors(chunk, dtype), meta, encoder=chunk.encoder, dtype=chunk.keys.dtype, device=chunk.keys.device
    )
    # a cast to the dtype a tensor has already is no copy: like a read, the stored form shares nothing with `chunk`
    given = {t.untyped_storage().data_ptr() for t in (chunk.token_ids, chunk.keys, chunk.values)}
    for name in ("token_ids", "keys", "values"):
        if getattr(back, name).untyped_storage().data_ptr() in given:
            setattr(back, name, getattr(back, name).clone())
    return back


def _stored_tensors(chunk: ChunkKV, dtype: str) -> dict[str, torch.Tensor]:
    """The tensors an entry in storage dtype `dtype` holds, on the CPU."""
    keys, values = chunk.keys.detach().cpu(), chunk.values.detach().cpu()
    if dtype == "int8":
        kq, ks = _quantize(keys)
        vq, vs = _quantize(values)
        tensors = {"keys": kq, "keys_scale": ks, "values": vq, "values_scale": vs}
    elif dtype in lowbit.FORMATS:
        f = lowbit.FORMATS[dtype]
        # keys [L, H_kv, D, T]: each channel over the chunk's tokens; values [L, H_kv, T, D_v]: each token over its
        # channels
        kc, ks, km = lowbit.quantize(keys.transpose(2, 3), bits=f.key_bits, group=f.key_group)
        vc, vs, vm = lowbit.quantize(values, bits=f.value_bits, group=f.value_group)
        tensors = {"keys": kc, "keys_scale": ks, "keys_min": km, "values": vc, "values_scale": vs, "values_min": vm}
    else:
        tensors = {
            "keys": keys.to(STORAGE_DTYPES[dtype]).contiguous(),
            "values": values.to(STORAGE_DTYPES[dtype]).contiguous(),
        }
    tensors["token_ids"] = chunk.token_ids.detach().cpu().to(torch.int64).contiguous()
    return tensors


def _read_back(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, str],
    *,
    encoder: str,
    dtype: torch.dtype | None,
    device: torch.device | str,
) -> ChunkKV:
    """The ChunkKV an entry's tensors hold, in `dtype` on `device` (raises on tensors of the wrong shape)."""
    if meta["dtype"] == "int8":
        keys = tensors["keys"].float() * tensors["keys_scale"]
        values = tensors["values"].float() * tensors["values_scale"]
    elif meta["dtype"] in lowbit.FORMATS:
        f, tokens = lowbit.FORMATS[meta["dtype"]], tensors["token_ids"].shape[0]
        keys = lowbit.dequantize(
            tensors["keys"], tensors["keys_scale"], tensors["keys_min"], tokens, bits=f.key_bits, group=f.key_group
        )
        keys = keys.transpose(2, 3)  # [L, H_kv, T, D] again (made contiguous below, after the cast)
        values = lowbit.dequantize(
            tensors["values"],
            tensors["values_scale"],
            tensors["values_min"],
            int(meta["value_dim"]),
            bits=f.value_bits,
            group=f.value_group,
        )
    else:
        keys, values = tensors["keys"], tensors["values"]
    return ChunkKV(
        token_ids=tensors["token_ids"].to(device),
        keys=keys.to(device=device, dtype=dtype).contiguous(),
        values=values.to(device=device, dtype=dtype),
        start=int(meta["start"]),
        encoder=encoder,
        behind=str(meta.get("behind", "")),
    )
