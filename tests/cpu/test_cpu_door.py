"""The CPU engine behind one door: the core imports `kvrag.cpu` and nothing inside it, and a model with the engine
off runs every answer on transformers' forward, giving the tokens the engine gives."""

import ast
import copy
from pathlib import Path

import pytest
import torch
from tiny import STRATEGY_CHUNKS, STRATEGY_QUESTION, byte_tokenizer, tiny_model

from kvrag import InvalidRequestError, KVModel, cpu
from kvrag.cpu import cbf16, ckernel
from kvrag.cpu.decode import compile_decoding

PACKAGE = Path(__file__).resolve().parents[2] / "kvrag"
OUTSIDE = ("cpu", "lab")  # the engine itself, and the benchmarks that time its parts


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_core_imports_the_cpu_engine_through_its_door_only():
    reached = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in OUTSIDE:
            continue
        inside = sorted(n for n in _imports(path) if n.startswith("kvrag.cpu."))
        if inside:
            reached[str(relative)] = inside
    assert reached == {}


def test_the_cpu_engine_imports_nothing_of_the_core_above_the_model():
    for path in (PACKAGE / "cpu").rglob("*.py"):
        above = [n for n in _imports(path) if n.startswith(("kvrag.run", "kvrag.plan", "kvrag.engine", "kvrag.lab"))]
        assert above == [], path.name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_the_engine_off_nothing_is_swapped_nothing_of_it_runs_and_the_tokens_are_the_same(dtype, monkeypatch):
    on_model = copy.deepcopy(tiny_model("llama")).to(dtype)
    on = KVModel(on_model, byte_tokenizer())
    expected = on.answer(STRATEGY_QUESTION, STRATEGY_CHUNKS, strategy="reuse", max_new_tokens=12)

    off_model = copy.deepcopy(tiny_model("llama")).to(dtype)
    off_model.set_attn_implementation("sdpa")  # the shared tiny model may have been given kvrag's by another test
    plain = {name: type(m) for name, m in off_model.named_modules()}
    called = []
    kernels = [(ckernel, n) for n in ("rotate_keys", "stitch_plan", "decode_attention")]
    kernels += [(cbf16, n) for n in ("prefill_layers", "prefill_linear", "prefill_rms_norm", "prefill_silu_mul")]
    kernels += [(cbf16, n) for n in ("prefill_rotary", "prefill_attention")]
    for module, name in kernels:
        monkeypatch.setattr(module, name, lambda *a, _n=name, **k: called.append(_n))
    off = KVModel(off_model, byte_tokenizer(), cpu_kernels=False)
    got = off.answer(STRATEGY_QUESTION, STRATEGY_CHUNKS, strategy="reuse", max_new_tokens=12)

    assert {name: type(m) for name, m in off_model.named_modules()} == plain
    assert off_model.config._attn_implementation == "sdpa"
    assert not cpu.enabled(off_model) and cpu.decoder_of(off_model) is None and called == []
    assert off.with_lead("A lead.").model is off_model and not cpu.enabled(off_model)
    assert got.token_ids == expected.token_ids


def test_runtimes_on_one_model_share_its_state_and_a_conflicting_one_is_refused():
    model = copy.deepcopy(tiny_model("llama"))
    first = KVModel(model, byte_tokenizer())
    second = KVModel(model, byte_tokenizer())  # the same settings: the same state, the same lock
    assert second.cpu_state is first.cpu_state is cpu.state_of(model) and second.lock is first.lock
    for asked, named in [
        ({"cpu_kernels": False}, "cpu_kernels=True.*asks for cpu_kernels=False"),
        ({"compile_decode": True}, "compile_decode=False.*asks for compile_decode=True"),
        ({"decode_weights": "int8"}, "decode_weights='model'.*asks for decode_weights='int8'"),
    ]:
        with pytest.raises(InvalidRequestError, match=f"{named}.*copy.deepcopy"):
            KVModel(model, byte_tokenizer(), **asked)
    assert first.cpu_state.settings() == {"cpu_kernels": True, "compile_decode": False, "decode_weights": "model"}
    assert cpu.enabled(model) and not first.cpu_state.compile_decode  # the refused ones changed nothing

    off = KVModel(copy.deepcopy(model), byte_tokenizer(), cpu_kernels=False)  # a copy has a state of its own
    assert not cpu.enabled(off.model) and cpu.enabled(model)
    compile_decoding(model)  # set on the model, for every runtime on it: a later one asks for what it has now
    try:
        assert first.with_lead("A lead.").cpu_state is first.cpu_state
        with pytest.raises(InvalidRequestError, match="compile_decode=True"):
            KVModel(model, byte_tokenizer())
    finally:
        compile_decoding(model, False)


def test_nothing_is_set_on_the_model_and_its_state_goes_with_it():
    import gc
    import weakref

    model = copy.deepcopy(tiny_model("llama")).to(torch.bfloat16)
    kv = KVModel(model, byte_tokenizer())
    kv.answer(STRATEGY_QUESTION, STRATEGY_CHUNKS, strategy="reuse", max_new_tokens=4)
    assert cpu.decoder_of(model) is kv.cpu_state.decoder is not None  # kept in the state, not on the model
    assert [(name, key) for name, m in model.named_modules() for key in vars(m) if key.startswith("_kvrag")] == []
    gone = weakref.ref(model)
    del kv, model
    gc.collect()
    assert gone() is None  # the state's decoder does not keep its model alive
