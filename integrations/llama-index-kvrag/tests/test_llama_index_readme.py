"""The README's snippets, run as written in a fresh folder: the stock engines on the embedded model; the traced
query engine and the pipeline / persist / load story on the tiny model (the `KVRAG.from_defaults(folder)` call
given `model=` the tiny model's folder, nothing else changed)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def run(code, folder, monkeypatch):
    monkeypatch.chdir(folder)
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})


def on_tiny_model(code, model_dir):
    code, n = re.subn(r'KVRAG\.from_defaults\("([^"]+)"\)', rf'KVRAG.from_defaults("\1", model="{model_dir}")', code)
    assert n == 1
    return code


def test_the_readme_has_the_three_snippets():
    assert len(SNIPPETS) == 3
    assert "as_query_engine" in SNIPPETS[0] and "as_chat_engine" in SNIPPETS[0]
    assert "LlamaDebugHandler" in SNIPPETS[1] and "persist(index, rag)" in SNIPPETS[2]


@pytest.mark.slow
def test_stock_query_and_chat_engines_snippet_on_the_embedded_model(tmp_path, monkeypatch, capsys):
    run(SNIPPETS[0], tmp_path, monkeypatch)
    query_answer, chat_answer = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "Orin Dask" in query_answer and "Orin Dask" in chat_answer


def test_traced_query_engine_snippet(tmp_path, monkeypatch, capsys, model_dir):
    run(on_tiny_model(SNIPPETS[1], model_dir), tmp_path, monkeypatch)
    out = capsys.readouterr().out
    for event in ("QUERY", "RETRIEVE", "SYNTHESIZE", "TEMPLATING", "LLM"):
        assert f"CBEventType.{event} ->" in out
    assert out.strip().splitlines()[-1] == "True 0"  # the LLM event's completion is the answer


def test_pipeline_persist_and_load_snippet(tmp_path, monkeypatch, capsys, model_dir):
    run(on_tiny_model(SNIPPETS[2], model_dir), tmp_path, monkeypatch)
    assert capsys.readouterr().out.strip().splitlines()[-1] == "True 0"
    assert (tmp_path / "kv-index" / "llama_index").is_dir() and any((tmp_path / "kv-index" / "kv").iterdir())
