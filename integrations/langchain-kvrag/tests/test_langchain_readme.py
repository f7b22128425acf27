"""The README's snippets, run in order in one namespace (as a reader pastes them), on the embedded default model."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_snippets_run_and_print_what_they_promise(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 4
    monkeypatch.chdir(tmp_path)  # "./my-index" lands here
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "forty" in out.lower() or "40" in out  # the answer reads the harbour fact
    assert "reuse 1 " in out  # the configured strategy, one store hit, top_k 1
    assert "model run: kvrag question: When does the Tam flood?" in out
    assert "'input_tokens'" in out and out.rstrip().endswith("True")  # loads reopened an engine that answers the same
    assert (tmp_path / "my-index" / "kv").is_dir()
