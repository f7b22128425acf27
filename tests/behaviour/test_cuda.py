"""kvrag on a CUDA device, against full prefill on that device.

Skipped where torch sees no CUDA device. The references are those of tests/behaviour/test_exactness.py, run on the GPU:
the recompute primitive on tiny random models of every supported architecture in float32 (TF32 off), greedy
tokens against transformers' generate, bfloat16 as close to float32 as a bfloat16 full prefill is, compiled
decoding, and the engine end to end (encode, store on disk, retrieve, stitch, recompute, decode).
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import ARCHS, FACTS, VOCAB, byte_tokenizer, save_tiny, tiny_model

from kvrag import KVModel
from kvrag.cache.kv import ChunkKV
from kvrag.model.encode import encode_chunks, encode_prefix, stacked_kv
from kvrag.model.rope import Repositioner
from kvrag.run.generate import Sampling, decode
from kvrag.model.recompute import full_prefill, recompute

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCH_NAMES = sorted(ARCHS)
CUDA = torch.device("cuda")
TOL = 2e-4
QUESTION = "Who built the lighthouse of Karsa?"


@pytest.fixture(scope="module", autouse=True)
def no_tf32():
    """float32 products in full float32: TF32 would make every comparison below a comparison of roundings."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_cuda(arch: str, dtype: torch.dtype = torch.float32):
    """A copy of the shared tiny model on the GPU (the shared one stays on the CPU for the other tests)."""
    return copy.deepcopy(tiny_model(arch)).to(CUDA, dtype)


def random_ids(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX, SUFFIX = random_ids(7, 1), random_ids(5, 2)
CHUNK_IDS = [random_ids(n, 10 + i) for i, n in enumerate((11, 6, 9))]


def reference(model, order):
    ids = PREFIX + [t for c in order for t in CHUNK_IDS[c]] + SUFFIX
    return full_prefill(model, ids, logits_to_keep=len(SUFFIX))


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def stitched(model, order, S):
    rep = Repositioner(model)
    prefix = encode_prefix(model, PREFIX)
    chunks = encode_chunks(model, prefix, CHUNK_IDS)
    return recompute(model, rep, prefix, chunks, order, S, SUFFIX, logits_to_keep=len(SUFFIX)), chunks


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_recompute_equals_full_prefill_on_the_gpu(arch):
    model = on_cuda(arch)
    order = [2, 0, 1]
    got, chunks = stitched(model, order, {c: torch.arange(len(CHUNK_IDS[c])) for c in order})
    ref = reference(model, order)
    assert got.logits.device.type == "cuda" and chunks[0].keys.device.type == "cuda"
    assert max_diff(got.logits, ref.logits) < TOL
    plain, _ = stitched(model, order, {})
    assert max_diff(plain.logits, ref.logits) > 1e-2, "stitching alone should not be exact here"


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_middle_chunk_recomputed_between_exact_neighbours_on_the_gpu(arch):
    model = on_cuda(arch)
    ref = reference(model, [0, 1, 2])
    exact, pos = [], len(PREFIX)
    for ids in CHUNK_IDS:
        k, v = stacked_kv(ref.cache, 0, pos, pos + len(ids))
        exact.append(ChunkKV(torch.tensor(ids), k, v, start=pos))
        pos += len(ids)
    garbage = ChunkKV(exact[1].token_ids, torch.randn_like(exact[1].keys) * 5, exact[1].values, start=exact[1].start)
    prefix = encode_prefix(model, PREFIX)
    S = {1: torch.arange(len(CHUNK_IDS[1]))}
    chunks = [exact[0], garbage, exact[2]]
    got = recompute(model, Repositioner(model), prefix, chunks, [0, 1, 2], S, SUFFIX, logits_to_keep=len(SUFFIX))
    assert max_diff(got.logits, ref.logits) < TOL
    # greedy tokens after the exact plan: those of a full prefill, and those of transformers' generate
    sampling = Sampling(max_new_tokens=12)
    tokens = list(decode(model, got.cache, got.logits[-1], got.next_position, sampling, eos_ids=[]))
    ids = PREFIX + [t for c in CHUNK_IDS for t in c] + SUFFIX
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=CUDA), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )
    assert tokens == out[0, len(ids) :].tolist() and len(tokens) == 12


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_bfloat16_recompute_is_as_close_to_float32_as_a_bfloat16_full_prefill(arch):
    order = [1, 2, 0]
    S = {c: torch.arange(len(CHUNK_IDS[c])) for c in order}
    want = reference(on_cuda(arch), order).logits
    model = on_cuda(arch, torch.bfloat16)
    prefill_error = max_diff(reference(model, order).logits, want)
    got, chunks = stitched(model, order, S)
    assert chunks[0].keys.dtype == torch.bfloat16 and got.logits.device.type == "cuda"
    assert max_diff(got.logits, want) <= 2 * prefill_error + 1e-3
    plain, _ = stitched(model, order, {})
    assert max_diff(plain.logits, want) > 4 * prefill_error, "the control must be far from float32"


@pytest.fixture(scope="module")
def tiny_kv():
    return KVModel(on_cuda("llama"), byte_tokenizer())


CHUNKS = [text for text, _ in FACTS[:3]]


def test_kvmodel_strategies_on_the_gpu(tiny_kv):
    kv = tiny_kv
    ids = kv.prompt_ids(QUESTION, [kv.layout.chunk_ids(c) for c in CHUNKS], [0, 1, 2])
    with torch.inference_mode():
        prompt = torch.tensor([ids], device=CUDA)
        out = kv.model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=kv.eos_ids)
    full = kv.answer(QUESTION, CHUNKS, strategy="full_prefill", max_new_tokens=10)
    assert full.token_ids == [t for t in out[0, len(ids) :].tolist() if t not in kv.eos_ids]
    chunks = kv.encode(CHUNKS)
    assert all(c.keys.device.type == "cuda" for c in chunks)
    # the exact plan over three chunks (first stored, two recomputed, the target last) is a full prefill in its order
    exact = kv.answer(QUESTION, chunks, strategy="top3_target_last", target=0, max_new_tokens=10)
    moved = kv.answer(QUESTION, [CHUNKS[i] for i in exact.stats.order], strategy="full_prefill", max_new_tokens=10)
    assert exact.token_ids == moved.token_ids
    for strategy in ("reuse", "target_recompute", "token_select"):
        a = kv.answer(QUESTION, chunks, strategy=strategy, target=0, max_new_tokens=4)
        assert a.stats.strategy == strategy and len(a.token_ids) <= 4


def test_compiled_decoding_on_the_gpu_gives_the_plain_steps_tokens(tiny_kv):
    from kvrag.cpu.decode import native_decoding

    plain = tiny_kv.answer(QUESTION, CHUNKS, target=1, max_new_tokens=12)
    compiled = KVModel(on_cuda("llama"), byte_tokenizer(), compile_decode=True)
    native_decoding(compiled.model, False)  # the compiled torch step, not the graph
    assert compiled.answer(QUESTION, CHUNKS, target=1, max_new_tokens=12).token_ids == plain.token_ids


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_decoding_gives_the_torch_steps_tokens_and_replays_across_answers(arch, dtype):
    from kvrag.cpu.decode import decoder_of, native_decoding

    model = on_cuda(arch, dtype)
    ids = PREFIX + [t for c in CHUNK_IDS for t in c] + SUFFIX

    def greedy(steps=16):
        out = full_prefill(model, ids)
        sampling = Sampling(max_new_tokens=steps)
        return list(decode(model, out.cache, out.logits[-1], out.next_position, sampling, eos_ids=[]))

    native_decoding(model, False)
    eager = greedy()
    native_decoding(model, True)
    graphs = decoder_of(model).graphs
    assert graphs is not None and graphs.captures == 0
    assert greedy() == eager
    assert graphs.captures == 1
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids], device=CUDA), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
        )
    if dtype == torch.float32:
        assert eager == out[0, len(ids) :].tolist()
    # a prefill of another length: new buffers, a new graph; the same tokens as the torch step's
    ids = ids[:-3]
    native_decoding(model, False)
    eager = greedy()
    native_decoding(model, True)
    assert greedy() == eager and graphs.captures == 2


def test_an_engine_on_the_gpu_replays_its_graph_across_answers(tiny_kv):
    from kvrag.cpu.decode import decoder_of

    first = tiny_kv.answer(QUESTION, CHUNKS, target=1, max_new_tokens=12)
    graphs = decoder_of(tiny_kv.model).graphs
    captured = graphs.captures
    again = tiny_kv.answer(QUESTION, CHUNKS, target=1, max_new_tokens=12)
    assert again.token_ids == first.token_ids and graphs.captures == captured  # the pooled buffers: a replay


@pytest.mark.usefixtures("hash_embedder")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_end_to_end_on_the_gpu(dtype, tmp_path):
    """Ingest (encode, store in float16 on disk), retrieve, stitch, recompute and decode, all on the GPU; a
    second engine over the same folder reads the stored KV back and answers the same."""
    from kvrag.engine.rag import KVRAG

    folder = save_tiny(tmp_path / "model")

    def engine():
        return KVRAG.from_defaults(
            tmp_path / "index", model=str(folder), device="cuda", dtype=dtype, cache_dir=tmp_path / "cache"
        )

    rag = engine()
    assert rag.kvmodel.model.device.type == "cuda" and str(rag.kvmodel.model.dtype) == f"torch.{dtype}"
    rag.ingest(FACTS, progress=False)
    first = rag.query(QUESTION, top_k=3, strategy="target_recompute", max_new_tokens=12)
    assert first.stats.strategy == "target_recompute" and first.stats.chunks_encoded == 0
    again = engine().query(QUESTION, top_k=3, strategy="target_recompute", max_new_tokens=12)
    assert again.stats.store_hits == 3 and again.stats.chunks_encoded == 0
    assert again.token_ids == first.token_ids
    if dtype == "float32":  # an exact plan through the engine is a full prefill in its order
        texts = [source.text for source in first.sources]
        exact = rag.answer(QUESTION, texts, strategy="top3_target_last", target=0, max_new_tokens=12)
        moved = [texts[i] for i in exact.stats.order]
        assert exact.token_ids == rag.answer(QUESTION, moved, strategy="full_prefill", max_new_tokens=12).token_ids
