"""Build the bundled Python-docs sample (chunks.jsonl, questions.jsonl, LICENSE.txt).

Usage:
    apt-get download python3.11-doc && dpkg-deb -x python3.11-doc_*.deb /tmp/pydoc
    python build_sample.py /tmp/pydoc [OUT_DIR]

Reads the reST sources shipped in the Debian package
(usr/share/doc/python3.11/html/_sources/), converts a few hand-picked entries
of some library pages to plain text and writes them as small chunks.
"""

import gzip
import json
import re
import sys
import textwrap
from pathlib import Path

# chunk id -> (page, entry keys). An entry is the text before the first
# directive ("intro"), one ".. function::"-like directive (keyed by its
# name, e.g. "wrap" or "TextWrapper.width") or a section (keyed by heading).
CHUNKS = {
    "textwrap-1": ("textwrap", ["wrap", "TextWrapper.width"]),
    "textwrap-2": ("textwrap", ["shorten"]),
    "textwrap-3": ("textwrap", ["dedent"]),
    "textwrap-4": (
        "textwrap",
        ["TextWrapper.initial_indent", "TextWrapper.subsequent_indent", "TextWrapper.max_lines"],
    ),
    "fnmatch-1": ("fnmatch", ["intro"]),
    "fnmatch-2": ("fnmatch", ["fnmatch", "fnmatchcase", "filter", "translate"]),
    "secrets-1": ("secrets", ["intro", "choice", "randbelow", "randbits"]),
    "secrets-2": ("secrets", ["Generating tokens", "token_bytes", "token_hex"]),
    "secrets-3": ("secrets", ["token_urlsafe", "compare_digest"]),
    "secrets-4": ("secrets", ["How many bytes should tokens use?"]),
    "keyword-1": ("keyword", ["intro", "iskeyword", "kwlist", "issoftkeyword", "softkwlist"]),
}

# (question, accepted answers (case-insensitive substrings), target chunk)
QUESTIONS = [
    ("What is the default width of textwrap.wrap?", ["70"], "textwrap-1"),
    ("What is the maxsize of the lru_cache used by fnmatch?", ["32768"], "fnmatch-1"),
    ("Which secrets function returns a random URL-safe text string?", ["token_urlsafe"], "secrets-3"),
    ("Which function returns True if s is a Python keyword?", ["iskeyword"], "keyword-1"),
]

ENTRY = re.compile(r"^(\s*)\.\. (function|class|method|attribute|data|exception)::\s*(.*)$")
SKIP = {
    "module",
    "moduleauthor",
    "sectionauthor",
    "index",
    "versionadded",
    "versionchanged",
    "deprecated",
    "audit-event",
    "seealso",
    "testsetup",
    "highlight",
    "",
}
LITERAL = {"doctest", "testcode", "code-block", "parsed-literal"}
MAX_CODE_LINES = 1  # longer code examples are dropped
STRICT = True  # an unknown directive is an error (build_api.py turns this off and drops them)


def add_code(out, text):
    """Append a code block, or drop it (and its "For example:" lead-in) if long."""
    text = textwrap.dedent(text).strip("\n").replace("  #doctest:+SKIP", "")
    if text and len(text.split("\n")) <= MAX_CODE_LINES:
        out.append(text)
    elif out and out[-1].endswith(":"):
        if "example" in out[-1].lower():
            out.pop()
        else:
            out[-1] = out[-1][:-1] + "."


INLINE = re.compile(
    r":pep:`(?P<pep>\d+)`"  # :pep:`506`
    r"|:\w+:`(?:~|\.(?=\w))?(?P<role>[^`<]*?)\s*(?:<[^`]*>)?`"  # :func:`f`, :term:`x <y>`
    r"|`(?P<link>[^`<]+?)\s*<[^`]*>`_"  # `text <url>`_
    r"|``(?P<lit>.+?)``"  # ``literal``
    r"|\*\*(?P<strong>.+?)\*\*"  # **strong**
    r"|(?<![\w*])\*(?P<em>\S.*?)\*(?!\w)"  # *emphasis*
    r"|\\(?P<esc>.?)"
)  # backslash escape


def inline(s):
    """Strip inline reST markup (one pass, so literals stay intact)."""

    def plain(m):
        if m["pep"]:
            return "PEP " + m["pep"]
        text = next(g for g in m.groups() if g is not None)
        return text if m["lit"] else re.sub(r"\\(.)", r"\1", text)

    return INLINE.sub(plain, s.replace(" --- ", " \u2014 "))


def render(lines):
    """Convert a block of reST lines to plain text paragraphs."""
    lines = textwrap.dedent("\n".join(lines)).split("\n")
    out, i, literal_next = [], 0, False
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
            continue
        # gather the block: this line plus following lines until a blank line
        # (for an indented block: until dedent)
        j = i + 1
        if line.startswith((" ", "..")) or literal_next:
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith(" ")):
                j += 1
        else:
            while j < len(lines) and lines[j].strip():
                j += 1
        block = lines[i:j]
        i = j
        m = re.match(r"\.\. ([\w-]*)::?\s*(.*)", block[0])
        if literal_next:
            add_code(out, "\n".join(block))
            literal_next = False
        elif block[0].startswith(" "):  # block quote / directive body
            text = render(block)
            out.append(text) if text else add_code(out, "")  # only dropped code
        elif block[0].startswith(".."):
            name = m.group(1) if m else ""
            body = [l for l in block[1:] if not re.match(r"\s+:\w+:", l)]
            if name == "note":
                out.append("Note: " + render(body))
            elif name in LITERAL:
                add_code(out, "\n".join(body))
            elif name not in SKIP and not name.startswith("_") and STRICT:  # _labels
                raise ValueError(f"unhandled directive {block[0]!r}")
        elif block[0].startswith("+"):  # grid table
            for row in block:
                if row.startswith("|"):
                    out.append(" ".join(inline(c.strip()) for c in row.strip("|").split("|")))
        elif block[0].startswith(">>>"):
            add_code(out, "\n".join(block))
        elif block[0].startswith("* "):  # bullet list
            out.append(inline(" ".join(" ".join(block).split())).replace(" * ", "\n* "))
        elif len(block) == 2 and set(block[1]) <= set("=-^*~") and block[1]:
            out.append(inline(block[0]))  # section heading
        elif set(block[0]) <= set("-=") or block[0].startswith("**Source code:**"):
            pass  # transition / source link
        else:
            text = " ".join(" ".join(block).split())
            if text.endswith("::"):
                literal_next = True
                text = text[:-2].rstrip() + (":" if not text.endswith(" ::") else "")
            if text:
                out.append(inline(text))
    return "\n".join(out)


def entries(path):
    """Split one page into {key: text}."""
    raw = path.read_text(encoding="utf-8")
    lines = []
    for line in raw.split("\n"):  # join continued signatures
        if lines and lines[-1].endswith("\\") and ENTRY.match(lines[-1]):
            lines[-1] = lines[-1][:-1].rstrip() + " " + line.strip()
        else:
            lines.append(line)
    module = path.name.split(".")[0]
    keys, blocks, cls = ["intro"], [[]], None
    for k, line in enumerate(lines):
        m = ENTRY.match(line)
        nxt = lines[k + 1] if k + 1 < len(lines) else ""
        if line.strip() and not line.strip().startswith(":") and len(blocks[-1]) == 1 and ENTRY.match(lines[k - 1]):
            blocks[-1].append(f"{module}.{line.strip()}")  # second signature
        elif m:
            indent, kind, sig = m.groups()
            name = sig.split("(")[0].strip()
            if kind == "class":
                cls = name
            elif indent and cls:
                name, sig = f"{cls}.{name}", f"{cls}.{sig}"
            keys.append(name)
            head = ("class " if kind == "class" else "") + f"{module}.{sig}"
            blocks.append([head])
        elif (
            nxt
            and not line.startswith(" ")
            and line.strip()
            and set(nxt) <= set("-^~")
            and len(nxt) >= len(line.strip())
            and not line.startswith(":mod:")
        ):
            keys.append(line.strip())  # section heading
            blocks.append([])
        elif not (line and set(line) <= set("-^~") and blocks[-1] == []):
            blocks[-1].append(line)  # (skips heading underlines)
    out = {}
    for key, block in zip(keys, blocks):
        if key == "intro" or not block or not block[0].startswith(("class ", module + ".")):
            out[key] = render(block)
        else:  # signature line(s), then the (indented) body
            n = 1 + sum(1 for line in block[1:3] if line.startswith(module + "."))
            out[key] = "\n".join(block[:n]) + "\n" + render(block[n:])
    return out


LICENSE_HEADER = """\
This directory holds a small excerpt of the Python 3.11 documentation
(Debian package python3.11-doc {version}), used as sample data by kvrag.

Pages taken (reST sources under usr/share/doc/python3.11/html/_sources/):
{pages}
Only some entries of each page were kept. They were converted from reST to
plain text (markup, index entries, version notes, "see also" boxes and code
examples longer than one line were removed) and cut into sections
("chunks.jsonl") by build_sample.py in this directory. The questions in
questions.jsonl were written for kvrag.

api_entries.jsonl holds every function and method entry (1,863 of them) of the
232 library pages whose signatures parse as Python, converted the same way
by build_api.py in this directory; the study's api_docs questions are
generated from it.

The Python documentation is distributed under the PSF License Agreement;
its copyright notice and license terms (copyright.rst, license.rst) follow.

"""


def license_text(src, version):
    """Header, copyright notice, PSF license and 0BSD license (for code)."""
    release = version.split("-")[0] if version[:1].isdigit() else "3.11"
    notice = (src / "copyright.rst.txt").read_text(encoding="utf-8")
    notice = notice.split("*********\n", 2)[2].split("-------")[0].strip()
    lic = (src / "license.rst.txt").read_text(encoding="utf-8")
    lic = re.sub(r":ref:`([^`<]*?)\s*(<[^`]*>)?`", r"\1", lic.replace("|release|", release))
    terms = lic.split("Terms and conditions")[1].split("=\n", 1)[1]
    terms = "\n\n".join(terms.strip().split("\n\n")[:2])  # skip "incorporated software"

    def section(label, stop):
        body = lic.split(f".. _{label}:")[1].split(stop)[0].strip()
        title, body = body.split("\n", 1)
        body = textwrap.dedent(body.split(".. parsed-literal::", 1)[1]).strip()
        return f"{title}\n{'-' * len(title)}\n\n{body}\n"

    pages = "".join(f"  library/{p}.rst\n" for p in dict.fromkeys(p for p, _ in CHUNKS.values()))
    return "\n".join(
        [
            LICENSE_HEADER.format(version=version, pages=pages).rstrip("\n") + "\n",
            "Copyright\n---------\n\n" + notice + "\n",
            "Terms and conditions\n--------------------\n\n" + terms + "\n",
            section("PSF-license", "BEOPEN.COM LICENSE"),
            section("BSD0", ".. _OtherLicenses:"),
        ]
    )


def main(root, out_dir):
    root, out_dir = Path(root), Path(out_dir)
    src = root / "usr/share/doc/python3.11/html/_sources"
    changelog = root / "usr/share/doc/python3.11-doc/changelog.Debian.gz"
    version = "unknown"
    if changelog.exists():
        version = re.search(r"\((.*?)\)", gzip.open(changelog, "rt").readline()).group(1)
    pages, texts = {}, {}
    with open(out_dir / "chunks.jsonl", "w", encoding="utf-8") as f:
        for cid, (page, keys) in CHUNKS.items():
            if page not in pages:
                pages[page] = entries(src / "library" / f"{page}.rst.txt")
            texts[cid] = "\n\n".join(pages[page][k] for k in keys)
            rec = {"id": cid, "source": f"library/{page}.rst", "text": texts[cid]}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    with open(out_dir / "questions.jsonl", "w", encoding="utf-8") as f:
        for q, answers, target in QUESTIONS:
            # the (first) answer must be stated in the target chunk and nowhere else
            found = [c for c, t in texts.items() if answers[0].lower() in t.lower()]
            assert found == [target], (q, found)
            rec = {"question": q, "answers": answers, "target": target}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    (out_dir / "LICENSE.txt").write_text(license_text(src, version), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else Path(__file__).parent)
