"""The README as written: its results are the committed runs' (made by `kvrag.lab.results`), and every Python
snippet runs as it stands, in a fresh folder, on the model it names (the quick start: the 0.5B, which answers it
right; the embedded 135M answered "Velloria's harbour is run by Orin Dask, not Velloria.")."""

import re
from pathlib import Path

import pytest

from kvrag.lab.results import table

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = README.read_text(encoding="utf-8")
SNIPPETS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def test_the_results_are_what_the_committed_runs_give():
    block = re.search(r"<!-- results:.*?-->\n(.*?)<!-- /results -->", TEXT, flags=re.S)
    assert block is not None and block.group(1) == table()


def test_the_readme_is_a_page_not_a_notebook():
    assert len(TEXT.splitlines()) <= 130 and len(SNIPPETS) == 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(2))
def test_each_snippet_runs_as_written(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(SNIPPETS[index], f"README.md snippet {index + 1}", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.strip()
    if index == 0:
        first, *parts = out.splitlines()
        assert first.startswith("Orin Dask ") and "Velloria" not in first and (tmp_path / "my-index").is_dir()
        assert first.endswith("#0']")  # the one chunk read
        assert "Orin Dask" in parts[0] and "noon" in parts[-1]
    else:
        assert "Rome" in out
