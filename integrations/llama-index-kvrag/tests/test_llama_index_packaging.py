"""Packaging: a module per LlamaIndex kind in the one distribution, each with a py.typed declared as package data,
`llama_index` and its kind levels left namespace packages, and the former import paths still working."""

import importlib
import importlib.resources
import subprocess
import sys
import tomllib
from pathlib import Path

MODULES = ["llama_index.llms.kvrag", "llama_index.embeddings.kvrag", "llama_index.retrievers.kvrag"]
MODULES += ["llama_index.query_engine.kvrag", "llama_index.question_gen.kvrag"]
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_each_kind_has_its_module_and_the_former_paths_re_export_them():
    from llama_index.embeddings.kvrag import KVRAGEmbedding
    from llama_index.llms.kvrag import KVRAGLLM
    from llama_index.query_engine import kvrag as query_engine
    from llama_index.query_engine.kvrag import components
    from llama_index.retrievers.kvrag import KVRAGRetriever

    for module in (query_engine, components):
        assert (module.KVRAGLLM, module.KVRAGEmbedding, module.KVRAGRetriever) == (
            KVRAGLLM,
            KVRAGEmbedding,
            KVRAGRetriever,
        )
    assert query_engine.KVRAGKVTransform is components.KVRAGKVTransform
    assert callable(query_engine.persist) and callable(query_engine.load)


def test_py_typed_in_each_module_and_declared_as_package_data():
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["tool"]["setuptools"]
    for name in MODULES:
        assert importlib.resources.files(name).joinpath("py.typed").is_file()
        assert project["package-data"][name] == ["py.typed"]
        assert f"{name}*" in project["packages"]["find"]["include"]


def test_llama_index_levels_stay_namespace_packages():
    for name in ["llama_index", "llama_index.llms", "llama_index.embeddings", "llama_index.retrievers"]:
        module = importlib.import_module(name)
        assert getattr(module, "__file__", None) is None, f"{name} has an __init__.py"  # namespace: no file
    importlib.import_module("llama_index.core")  # still found beside ours


def test_imports_from_another_directory(tmp_path):
    code = "; ".join(f"import {m}" for m in MODULES) + "; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
