"""The compiled decode step (torch.compile'd layer steps) gives the eager step's logits to float32 rounding on
every architecture the fast step takes, its tokens and cache through `decode`, and falls back to the eager step,
with a warning, where compiling fails."""

import shutil
import warnings

import pytest
import torch
from tiny import FAST_DECODED, tiny_config
from transformers import AutoModelForCausalLM

from kvrag.cpu import ckernel
from kvrag.cpu.decode import BLOCK, Room, compile_decoding, decode_room, decoder_of, native_decoding
from kvrag.run.generate import Sampling, decode
from kvrag.model.recompute import full_prefill

NO_COMPILER = not any(shutil.which(c) for c in ("g++", "c++", "clang++"))
needs_compiler = pytest.mark.skipif(NO_COMPILER, reason="torch.compile's CPU backend needs a C++ compiler")
TAKEN = FAST_DECODED


def _fresh(name):
    """A tiny model of its own (compiling sets state on the model: the shared tiny models stay eager), on the
    torch step (the C step, where it builds, would decode in place of the compiled one)."""
    torch.manual_seed(0)
    config = tiny_config(name)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    native_decoding(model, False)
    return model


def _ids(n, seed=1):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@needs_compiler
@pytest.mark.parametrize("c_kernel", [True, False], ids=["C kernel attention", "inductor attention"])
@pytest.mark.parametrize("name", TAKEN)
def test_each_compiled_step_matches_the_whole_sequence_forward(name, c_kernel, monkeypatch):
    calls = []
    if not c_kernel:  # the compiled step's own attention, where the C kernel did not build
        monkeypatch.setattr(ckernel, "supports", lambda *args: False)
    elif not ckernel.available():
        pytest.skip("no C compiler for kvrag.cpu.ckernel")
    else:
        attend = ckernel.decode_attention
        monkeypatch.setattr(
            ckernel, "decode_attention", lambda *args, **kw: calls.append(args[3]) or attend(*args, **kw)
        )
    model = _fresh(name)
    assert compile_decoding(model)
    decoder = decoder_of(model)
    assert decoder.compiled is not None
    ids = _ids(60, seed=2)
    reference = model(torch.tensor([ids])).logits[0].float()  # [T, V] over the whole sequence at once
    out = full_prefill(model, ids[:20])
    room = Room.of(out.cache, decode_room(model, 40))
    assert room.keys[0].shape[1] >= BLOCK
    torch.nn.init.constant_(room.keys[0][:, 20:], float("nan"))  # free slots may hold anything: never read
    torch.nn.init.constant_(room.values[0][:, 20:], float("inf"))
    cos, sin = decoder.rotary(20, 40)
    for step, token in enumerate(ids[20:]):  # 40 steps over a growing cache: one compile, a dynamic length
        logits = decoder.step(token, cos[step], sin[step], room.keys, room.values, room.filled + step)
        torch.testing.assert_close(logits, reference[20 + step], rtol=1e-4, atol=1e-4)
    assert decoder._compiled_ran and decoder.compiled is not None  # the compiled path ran, and never fell back
    assert len(calls) == (40 * model.config.num_hidden_layers if c_kernel else 0)  # the kernel attended, or none


@needs_compiler
@pytest.mark.parametrize("c_kernel", [True, False], ids=["C kernel attention", "inductor attention"])
def test_attention_blocks_merge_across_a_block_boundary(c_kernel, monkeypatch):
    if not c_kernel:
        monkeypatch.setattr(ckernel, "supports", lambda *args: False)
    model = _fresh("llama")
    compile_decoding(model)
    decoder = decoder_of(model)
    ids = _ids(BLOCK + 8, seed=3)
    start = BLOCK - 4  # the steps cross from one block into two
    reference = model(torch.tensor([ids])).logits[0].float()
    out = full_prefill(model, ids[:start])
    room = Room.of(out.cache, decode_room(model, 12))
    cos, sin = decoder.rotary(start, 12)
    for step, token in enumerate(ids[start : start + 12]):
        logits = decoder.step(token, cos[step], sin[step], room.keys, room.values, room.filled + step)
        torch.testing.assert_close(logits, reference[start + step], rtol=1e-4, atol=1e-4)
    assert decoder._compiled_ran


def test_without_whole_blocks_of_room_the_eager_step_decodes():
    model = _fresh("llama")
    compile_decoding(model)
    decoder = decoder_of(model)
    out = full_prefill(model, _ids(20))
    room = Room.of(out.cache, 4)  # room for 4 tokens, not for a block: a caller that skipped decode_room
    cos, sin = decoder.rotary(20, 4)
    decoder.step(5, cos[0], sin[0], room.keys, room.values, room.filled)
    assert not decoder._compiled_ran and decoder.compiled is not None  # eager this time, compiled still on


@needs_compiler
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_compiled_decode_gives_the_eager_tokens_and_cache(name):
    model = _fresh(name)
    ids = _ids(90)

    def run():
        out = full_prefill(model, ids)
        steps = decode(model, out.cache, out.logits[-1], out.next_position, Sampling(max_new_tokens=40), eos_ids=())
        return list(steps), out.cache

    eager, eager_cache = run()
    compile_decoding(model)
    compiled, compiled_cache = run()
    assert compiled == eager and len(set(eager)) > 3
    for a, b in zip(eager_cache.layers, compiled_cache.layers):
        assert a.keys.shape == b.keys.shape == (1, a.keys.shape[1], 90 + 39, a.keys.shape[-1])
        torch.testing.assert_close(b.keys, a.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.values, a.values, rtol=1e-4, atol=1e-4)
    compile_decoding(model, enabled=False)
    assert decoder_of(model).compiled is None
    assert run()[0] == eager


def test_a_failing_compiler_warns_once_and_the_eager_step_decodes(monkeypatch):
    model = _fresh("llama")
    decoder = decoder_of(model)
    ids = _ids(30)
    out = full_prefill(model, ids)
    room = Room.of(out.cache, BLOCK)
    cos, sin = decoder.rotary(30, 4)
    expected = decoder.step(5, cos[0], sin[0], room.keys, room.values, room.filled)

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    decoder.compiled = (broken, broken)
    with pytest.warns(RuntimeWarning, match="compiled decoding is off.*no C\\+\\+ compiler found"):
        logits = decoder.step(5, cos[0], sin[0], room.keys, room.values, room.filled)
    assert torch.equal(logits, expected) and decoder.compiled is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoder.step(7, cos[1], sin[1], room.keys, room.values, room.filled + 1)  # eager now, and silent


def test_a_failure_after_the_compiled_step_ran_is_raised():
    model = _fresh("llama")
    decoder = decoder_of(model)
    out = full_prefill(model, _ids(30))
    room = Room.of(out.cache, BLOCK)
    cos, sin = decoder.rotary(30, 4)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    decoder.compiled, decoder._compiled_ran = (broken, broken), True
    with pytest.raises(RuntimeError, match="out of memory"):
        decoder.step(5, cos[0], sin[0], room.keys, room.values, room.filled)


def test_compile_is_refused_quietly_where_the_fast_step_does_not_take_the_model():
    model = _fresh("phi3")
    assert not compile_decoding(model)
    assert decoder_of(model) is None  # it decodes through transformers, as it did
