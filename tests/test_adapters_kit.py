"""The LlamaIndex and LangChain integrations reach kvrag through its public names and `kvrag.adapters` only, so
kvrag's folders may move without breaking them."""

import ast
from pathlib import Path

import kvrag.adapters

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = [ROOT / "integrations" / "llama-index-kvrag" / "llama_index", ROOT / "integrations" / "langchain-kvrag"
            / "langchain_kvrag"]


def test_the_framework_integrations_import_only_kvrag_and_its_adapter_kit():
    found = {}
    for package in PACKAGES:
        for path in package.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvrag":
                    found.setdefault(node.module, set()).add(path.relative_to(ROOT).as_posix())
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] == "kvrag":
                            found.setdefault(alias.name, set()).add(path.relative_to(ROOT).as_posix())
    assert set(found) <= {"kvrag", "kvrag.adapters"}, {m: sorted(p) for m, p in found.items() if m.count(".")}
    assert "kvrag.adapters" in found  # the kit is used, so this test cannot pass on an empty walk
    for name in kvrag.adapters.__all__:
        assert getattr(kvrag.adapters, name) is not None
