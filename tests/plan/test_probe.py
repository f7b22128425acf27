"""kvrag.plan.probe: measurements on the model (value deviation, question attention, question likelihood, the
full-prefill KV of a chunk), each costed; a probe reads a request's chunk KV only when a measurement needs it."""

import pytest
import torch
from tiny import byte_tokenizer, tiny_model

from kvrag import KVModel
from kvrag.cache.chunks import ChunkSource
from kvrag.cache.kv import ChunkKV
from kvrag.model.encode import stacked_kv
from kvrag.plan.probe import Probe
from kvrag.model.recompute import full_prefill


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt_neox", "gemma"])
def test_probes_work_on_every_architecture(arch):
    from tiny import VOCAB

    from kvrag.model.encode import encode_chunks, encode_prefix
    from kvrag.model.rope import Repositioner

    model = tiny_model(arch)
    attention = model.config._attn_implementation  # sdpa, or kvrag_sdpa once a KVModel has been built on it
    g = torch.Generator().manual_seed(0)
    prefix = encode_prefix(model, torch.randint(0, VOCAB, (5,), generator=g).tolist())
    ids = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 9, 7)]
    chunks = encode_chunks(model, prefix, ids)
    full = prefix.token_ids.tolist() + sum(ids, [])
    ref = full_prefill(model, full)
    rep = Repositioner(model)
    exact = []
    pos = len(prefix)
    for c in chunks:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(c))
        exact.append(ChunkKV(c.token_ids, k, v, start=pos))
        pos += len(c)
    assert Probe(model, rep, prefix, exact, [1, 2]).value_deviation([0, 1, 2]).max() < 1e-8
    stale = Probe(model, rep, prefix, chunks, [1, 2]).value_deviation([0, 1, 2])
    assert stale[:6].max() < 1e-8 < stale[6:].max()  # the first chunk is exact, the others are not
    mass = Probe(model, rep, prefix, chunks, [1, 2, 3]).chunk_attention([2, 0, 1])
    assert mass.shape == (3,) and (mass > 0).all() and mass.sum() < 1
    assert model.config._attn_implementation == attention  # restored after the eager pass


def test_a_probe_reads_no_chunk_kv_until_a_measurement_asks_and_then_reads_each_once():
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    chunks = ChunkSource(kv).chunks(["First chunk of text.", "Second chunk, a little longer."])
    probe = Probe.of(kv, chunks, kv.layout.suffix_ids("Which chunk?"), "Which chunk?")
    assert chunks.encoded == 0 and probe.texts == ["First chunk of text.", "Second chunk, a little longer."]
    with kv.lock:
        probe.question_likelihood()
        probe.chunk_attention([1, 0])
    assert chunks.encoded == 2  # both measurements read the same two encodings
    assert probe.extra_token_layers > 0 and len(probe.extra_work) == 2


def test_the_full_prefill_kv_of_a_chunk_is_its_slice_of_a_full_prefill_and_is_reported():
    kv = KVModel(tiny_model("qwen2"), byte_tokenizer())
    enc = kv.encode(["A first chunk.", "A second chunk.", "A third one."])
    made = []

    class Keeping(Probe):
        def full_prefill_made(self, ids, cache):
            made.append(ids)

    probe = Keeping(kv.model, kv.repositioner, kv.prefix, enc, [1, 2])
    got = probe.full_prefill_kv([2, 0, 1], 0)
    ids = kv.layout.prefix_ids + enc[2].token_ids.tolist() + enc[0].token_ids.tolist()
    want_k, want_v = stacked_kv(full_prefill(kv.model, ids).cache, 0, len(ids) - len(enc[0]), len(ids))
    torch.testing.assert_close(got.keys, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.values, want_v, rtol=1e-5, atol=1e-5)
    assert got.start == len(ids) - len(enc[0]) and made == [ids]
    assert probe.extra_token_layers == len(ids) * kv.model.config.num_hidden_layers


def test_a_probe_over_chunk_kv_alone_has_no_texts():
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    probe = Probe(kv.model, kv.repositioner, kv.prefix, kv.encode(["x y z"]), [1, 2])
    with pytest.raises(ValueError, match="without a request's texts"):
        probe.texts
