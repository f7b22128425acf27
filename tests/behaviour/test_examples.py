"""The runnable example apps, each in its quick mode, as a user runs them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_api_docs_assistant_in_a_llama_index_pipeline():
    out = run_example("api_docs_assistant.py", "--quick")
    assert "ingested 11 nodes from 4 pages" in out
    assert out.count("Q: ") == 1 and "kvrag        | " in out and "full prefill | " in out
    assert "ttft: kvrag" in out and "(target_only" in out and "library/textwrap.rst" in out


def test_open_domain_qa_as_a_langchain_chain():
    out = run_example("open_domain_qa.py", "--quick")
    assert "ingested 12 articles" in out and out.count("Q: ") == 2
    assert out.count("   kvrag        ttft ") == 2 and out.count("   full prefill ttft ") == 2
    assert "right: kvrag " in out


def test_dialogue_memory_assistant():
    out = run_example("dialogue_memory.py", "--quick")
    line = r"^    {} +ttft +\d+\.\d+ s  (right|wrong)  \| .+$"
    assert re.search(r"^ingested 4 sessions \(\d+ tokens\)", out, re.M), out
    assert len(re.findall(r"^Q\d+ \[\S+\] What is .+\?", out, re.M)) == 2, out
    assert len(re.findall(r"^    retrieved( s\d\d){4}; the top one is the target: (True|False)$", out, re.M)) == 2, out
    for strategy in ("target_recompute", "full_prefill"):
        assert len(re.findall(line.format(strategy), out, re.M)) == 2, out
        assert re.search(rf"^{strategy} +right [0-2] of 2, median ttft \d+\.\d+ s$", out, re.M), out
