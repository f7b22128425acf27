"""Build api_entries.jsonl: every documented function of the Python 3.11 library pages, as plain text.

Usage:
    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python build_api.py /tmp/pydoc [OUT_DIR]

Each line is one `.. function::` / `.. method::` entry whose signature parses as Python: its id
("<module>.<name>"), the page, the signature line, the entry's text (signature, then the description,
converted from reST by build_sample.py's converter) and its parameters with their defaults. The study's
`api_docs` questions are generated from this file (kvrag.study.builtin); nothing is read at run time
but this file.
"""

import ast
import json
import re
import sys
from pathlib import Path

import build_sample
from build_sample import entries

MAX_CHARS = 900  # about 250 tokens: longer entries are cut at a line end
MIN_CHARS = 280  # about 80 tokens


def parameters(signature):
    """[(name, default source or None)] of a reST signature, or None when it is not Python syntax."""
    head = signature.split("(", 1)
    if len(head) != 2 or not signature.rstrip().endswith(")"):
        return None
    try:
        tree = ast.parse(f"def f({head[1].rstrip()[:-1]}): pass")
    except SyntaxError:
        return None
    args = tree.body[0].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, d) for a, d in zip(positional, defaults)]
    out += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return [
        (name, ast.get_source_segment(f"def f({head[1].rstrip()[:-1]}): pass", d) if d else None) for name, d in out
    ]


def main(root, out_dir):
    src = Path(root) / "usr/share/doc/python3.11/html/_sources/library"
    build_sample.STRICT = False  # drop directives the converter does not know instead of skipping the page
    rows = []
    for page in sorted(src.glob("*.rst.txt")):
        try:
            found = entries(page)
        except (ValueError, StopIteration, IndexError):
            continue  # a page with markup the small converter does not handle
        short, module = page.name.split(".")[0], page.name.removesuffix(".rst.txt")
        for key, text in found.items():
            first = text.split("\n", 1)[0]
            if not first.startswith(short + ".") or "(" not in first or len(text) < MIN_CHARS:
                continue
            if module == "functions":  # the built-in functions page
                first, text = first.removeprefix("functions."), text.removeprefix("functions.")
            elif module != short:  # os.path's entries read "os.join(...)": give them their real module
                first, text = module + first[len(short) :], module + text[len(short) :]
            # a method documented as "Class.name" inside its class reads "Class.Class.name": say it once
            first, text = (re.sub(r"\b(\w+)\.\1\.", r"\1.", t, count=1) for t in (first, text))
            key = re.sub(r"\b(\w+)\.\1\.", r"\1.", key, count=1)
            params = parameters(first)
            if params is None:
                continue
            if len(text) > MAX_CHARS:
                text = text[: text.rfind("\n", 0, MAX_CHARS)] if "\n" in text[:MAX_CHARS] else ""
            if len(text) < MIN_CHARS:
                continue
            rows.append(
                {
                    "id": key if module == "functions" else f"{module}.{key}",
                    "page": f"library/{page.name.removesuffix('.txt')}",
                    "signature": first,
                    "text": text,
                    "params": [{"name": n, "default": d} for n, d in params],
                }
            )
    out = Path(out_dir) / "api_entries.jsonl"
    with out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} entries from {len({r['page'] for r in rows})} pages -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else Path(__file__).parent)
