"""The import graph of kvrag/: one direction, no circle, no private name taken from another module.

Every `import` and `from ... import` in kvrag/ is read with `ast`, at any depth (inside functions and under
`TYPE_CHECKING` too: a type-only arrow is still an arrow a reader follows). The layers, lowest first, are the order
docs/architecture.md gives; a module may import its own layer or any below it, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "kvrag"

# Lowest first; a module takes the layer of the longest prefix that names it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("kvrag.errors", "kvrag.timing", "kvrag.compat", "kvrag.files", "kvrag.answer", "kvrag.rank")),
    ("cpu", ("kvrag.cpu",)),
    ("cache", ("kvrag.cache",)),  # the chunk KV type and key, the codec, the secret, the stores
    ("model", ("kvrag.model",)),  # the model runtime: loading, layout, encoding, re-positioning, forwards, lock
    ("chunks", ("kvrag.cache.chunks",)),  # how a request's chunks become KV
    ("plan", ("kvrag.plan",)),
    ("run", ("kvrag.run",)),
    ("facade", ("kvrag.kvmodel", "kvrag.model.kvmodel", "kvrag.engine")),  # the old path of KVModel, re-exported
    ("top", ("kvrag", "kvrag.adapters", "kvrag.cli", "kvrag.lab", "kvrag.data", "kvrag.__main__")),
]
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> str:
    best, length = "top", -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = name, len(prefix)
    return best


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported kvrag module, names taken from it) for every import in the file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.split(".")[0] == "kvrag"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "kvrag":
                continue
            names = []
            for alias in node.names:
                child = f"{source}.{alias.name}"
                if child in known:  # `from kvrag.cpu import decode`: the submodule itself
                    out.append((child, []))
                else:
                    names.append(alias.name)
            if names:
                out.append((source, names))
    return out


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """The module graph and every (importer, source, name) of a private name taken across modules."""
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    private: list[tuple[str, str, str]] = []
    for module, path in known.items():
        for source, names in imports(module, path, known):
            if source != module:
                edges[module].add(source)
                private += [(module, source, n) for n in names if n.startswith("_") and not n.startswith("__")]
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({layer(a)}) -> {b} ({layer(b)})"
        for a, targets in edges.items()
        for b in targets
        if RANK[layer(b)] > RANK[layer(a)]
    )


def test_no_import_cycle() -> None:
    assert cycles(graph()[0]) == []


def test_imports_point_down_the_layers() -> None:
    assert upward(graph()[0]) == []


def test_no_private_name_imported_across_modules() -> None:
    assert [f"{a} imports {n} from {b}" for a, b, n in graph()[1]] == []


if __name__ == "__main__":  # the counts, for a report
    edges, private = graph()
    found = cycles(edges)
    print(f"cycles: {len(found)} ({', '.join(str(len(c)) for c in found)} modules)")
    for c in found:
        print("  ", " ".join(c))
    up = upward(edges)
    print(f"upward arrows: {len(up)}")
    for line in up:
        print("  ", line)
    print(f"private imports: {len(private)}")
    for a, b, n in private:
        print(f"   {a} <- {b}.{n}")
