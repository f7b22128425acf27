"""The kvrag command line, in-process, on a tiny model folder: answers, JSON, and one-line errors with exit 2."""

import json

import pytest
from tiny import save_tiny

from kvrag.cli import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = root / "model"
    save_tiny(model)
    docs = root / "docs"
    docs.mkdir()
    (docs / "ships.txt").write_text("The harbour of Velloria holds forty ships.")
    (docs / "mill.md").write_text("The mill of Brenn grinds barley.")
    return root, model, docs


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_ingest_ask_info(setup, capsys):
    root, model, docs = setup
    index = root / "index"
    code, out, _ = run(capsys, "ingest", docs, "--index", index, "--model", model, "--cache-dir", root / "c", "--quiet")
    assert code == 0 and "2 documents, 2 chunks" in out and "KV encoded for 2" in out
    code, out, _ = run(capsys, "ingest", docs, "--index", index, "--quiet")
    assert code == 0 and "already stored for 2" in out
    code, out, _ = run(
        capsys, "ask", "How many ships?", "--index", index, "--json", "--top-k", "2", "--max-new-tokens", "4"
    )
    answer = json.loads(out)
    assert code == 0 and set(answer) == {"text", "finish_reason", "abstained", "sources", "stats"}
    assert answer["stats"]["chunks_encoded"] == 0 and answer["stats"]["store_hits"] == 2
    assert answer["sources"][0]["text"].startswith("The harbour")
    code, out, _ = run(capsys, "ask", "How many ships?", "--index", index, "--stream", "--max-new-tokens", "4")
    assert code == 0 and out.endswith("\n")
    code, out, _ = run(capsys, "info", "--index", index)
    info = json.loads(out)
    assert (
        code == 0
        and info["chunks"] == 2
        and info["kv_entries"] == 2
        and info["model"]["architecture"].startswith("llama")
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ask", "q?", "--index", "{root}/missing"], "no kvrag index at"),
        (["info", "--index", "{root}/missing"], "no kvrag index at"),
        (["ingest", "{root}/nope.txt", "--index", "{root}/i2", "--model", "{model}"], "does not exist"),
        (["ingest", "{root}/empty", "--index", "{root}/i3", "--model", "{model}"], "holds no file kvrag can read"),
        (["ask", "q?", "--index", "{root}/index", "--strategy", "magic"], "unknown strategy 'magic'"),
        (["ask", "q?", "--index", "{root}/index", "--budget", "2"], "budget must be"),
        (["ask", "q?", "--index", "{root}/index", "--top-k", "0"], "top_k must be"),
        (["ask", "  ", "--index", "{root}/index"], "question is empty"),
        (["ask", "q?", "--index", "{root}/index", "--device", "tpu9"], "unknown device 'tpu9'"),
        (
            ["ask", "q?", "--index", "{root}/index", "--vllm-server", "http://h:8000"],
            "--vllm-server goes with --backend",
        ),
        (["ask", "q?", "--index", "{root}/docs/ships.txt"], "is a file, not an index folder"),
        (["ingest", "{root}/docs", "--index", "{root}/docs/mill.md", "--model", "{model}"], "is a file, not an index"),
        (["ask", "q?", "--index", "{root}/index", "--parts", "Who?;; "], "part 1 is ' ': give a non-empty question"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(setup, capsys, argv, message):
    root, model, _ = setup
    (root / "empty").mkdir(exist_ok=True)
    if not (root / "index").exists():
        run(capsys, "ingest", setup[2], "--index", root / "index", "--model", model, "--quiet")
    code, out, err = run(capsys, *[a.format(root=root, model=model) for a in argv])
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_the_footer_tells_the_chunks_read_from_those_only_retrieved_and_names_the_plan(setup, capsys):
    root, model, docs = setup
    if not (root / "index").exists():
        run(capsys, "ingest", docs, "--index", root / "index", "--model", model, "--quiet")
    argv = ["ask", "How many ships?", "--index", root / "index", "--top-k", "2", "--max-new-tokens", "4"]
    code, out, _ = run(capsys, *argv, "--strategy", "target_only", "--json")
    sources = json.loads(out)["sources"]
    read = [s["id"] for s in sources if s["read"]]
    unread = [s["id"] for s in sources if not s["read"]]
    assert code == 0 and len(read) == 1 and len(unread) == 1
    for mode in ([], ["--stream"]):  # streamed, the same footer follows the text
        code, out, _ = run(capsys, *argv, "--strategy", "target_only", *mode)
        footer = out.rstrip("\n").splitlines()[-3:]
        assert code == 0 and footer[0].startswith("[target_only, ttft ")
        assert footer[1:] == [f"read: {read[0]}", f"retrieved, not read: {unread[0]}"]
    code, out, _ = run(capsys, *argv, "--strategy", "full_prefill")
    assert code == 0 and out.rstrip("\n").splitlines()[-1] == f"read: {', '.join(s['id'] for s in sources)}"


@pytest.mark.parametrize("command", [["ask", "How many ships?", "--max-new-tokens", "2"], ["info"], ["verify"],
                                     ["gc", "--dry-run"], ["ingest", "{docs}", "--quiet"]])  # fmt: skip
def test_every_command_takes_model_and_checks_it_against_the_index(setup, capsys, command):
    root, model, docs = setup
    if not (root / "index").exists():
        run(capsys, "ingest", docs, "--index", root / "index", "--model", model, "--quiet")
    argv = [a.format(docs=docs) for a in command] + ["--index", root / "index"]
    code, _, err = run(capsys, *argv, "--model", model)
    assert code == 0, err
    code, _, err = run(capsys, *argv, "--model", "qwen2.5-coder-0.5b")
    assert code == 2 and err.count("\n") == 1
    assert f"--model qwen2.5-coder-0.5b conflicts with the index at {root / 'index'}, built with model" in err


def test_model_names_the_embedded_default_and_models_takes_model(tmp_path, capsys):
    from kvrag.cli.common import same_model

    assert same_model("smollm2-135m", None) and same_model("SmolLM2-135M", None)
    assert not same_model("qwen2.5-coder-0.5b", None) and same_model("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B")
    assert not same_model(str(tmp_path), None) and same_model(str(tmp_path), str(tmp_path / "."))
    code, out, err = run(capsys, "models", "--model", "qwen2.5-coder-0.5b", "--json")
    assert code == 0 and [json.loads(line)["name"] for line in out.splitlines()] == ["qwen2.5-coder-0.5b"]
    code, _, err = run(capsys, "models", "--model", "gpt-9")
    assert code == 2 and "not a named model" in err


def test_models_says_what_each_model_answers_with_by_default(capsys):
    """The plan, decode weights, stored KV and encoding a user gets without a flag, from the catalog and the shipped
    defaults (not restated here: read back from where they are decided)."""
    from kvrag.model.catalog import QWEN_15B, SMOLLM2_135M
    from kvrag.plan.defaults import shipped_default

    code, out, _ = run(capsys, "models", "--json")
    rows = {row["name"]: row for row in map(json.loads, out.splitlines())}
    for model in (QWEN_15B, SMOLLM2_135M):
        row = rows[model.name]
        assert row["plan"].split(":")[0] == shipped_default(model.weights)["strategy"]
        assert (row["decode_weights"], row["storage_dtype"], row["encoding"], row["header"]) == (
            model.decode_weights, model.storage_dtype, model.encoding, model.header
        )
    assert rows[QWEN_15B.name]["declines"] and not rows[SMOLLM2_135M.name]["declines"]
    code, out, _ = run(capsys, "models", "--model", "qwen2.5-coder-1.5b")
    assert code == 0 and "by default: plan by_need (questions split into parts); decodes over int4 copies; " in out
    assert "stores k4v3 KV; encodes chunks in their document's context; asks the model to say when the" in out


def test_ask_with_parts_answers_each_part_over_the_same_chunks(setup, capsys):
    root, model, docs = setup
    if not (root / "index").exists():
        run(capsys, "ingest", docs, "--index", root / "index", "--model", model, "--quiet")
    question = "How many ships are in the harbour, and what does the mill grind?"
    argv = ["ask", question, "--index", root / "index", "--parts", "auto", "--json", "--max-new-tokens", "3"]
    code, out, _ = run(capsys, *argv)
    answer = json.loads(out)
    assert code == 0 and len(answer["parts"]) == 2 and answer["text"].count("\n") == 1
    given = ["How many ships?;;What does the mill grind?"]
    code, out, _ = run(capsys, "ask", question, "--index", root / "index", "--parts", *given, "--json",
                       "--max-new-tokens", "3")
    assert code == 0 and len(json.loads(out)["parts"]) == 2


def test_a_reader_that_goes_away_ends_the_command_quietly(setup, tmp_path):
    import subprocess
    import sys

    root, model, docs = setup
    if not (root / "index").exists():
        main(["ingest", str(docs), "--index", str(root / "index"), "--model", str(model), "--quiet"])
    # `kvrag models` into a pipe closed at once: no "Broken pipe" message and no traceback, 141 like cat
    code = (
        "import sys, os\n"
        "from kvrag.cli import main\n"
        "r, w = os.pipe(); os.close(r); os.dup2(w, sys.stdout.fileno())\n"
        "sys.exit(main(['models', '--cache-dir', sys.argv[1]]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 141 and done.stderr == ""


def test_the_vllm_backend_without_vllm_kvrag_says_where_to_get_it(setup, capsys):
    import importlib.util

    if importlib.util.find_spec("vllm_kvrag") is not None:
        pytest.skip("vllm-kvrag is installed here: its own tests run the vLLM backend")
    root, model, docs = setup
    if not (root / "index").exists():
        run(capsys, "ingest", docs, "--index", root / "index", "--model", model, "--quiet")
    for argv in (["ask", "q?", "--index", root / "index", "--backend", "vllm"], ["bench-vllm", "--help"]):
        code, out, err = run(capsys, *argv)
        assert code == 2 and "needs vllm-kvrag and vLLM" in err and "make install-vllm" in err and out == ""


def test_the_vllm_backend_starts_its_engine_eager_for_one_question(setup, capsys, monkeypatch):
    """`kvrag ask --backend vllm` starts vLLM for one question: not compiled (minutes on a CPU); a server is its own."""
    from types import SimpleNamespace

    import kvrag.cli.ask

    root, model, docs = setup
    if not (root / "index").exists():
        run(capsys, "ingest", docs, "--index", root / "index", "--model", model, "--quiet")
    calls = []

    def attach(rag, **options):  # the engine answers as it is: what matters is what vLLM would be started with
        calls.append(options)
        return rag

    fake = SimpleNamespace(attach=SimpleNamespace(attach=attach))
    monkeypatch.setattr(kvrag.cli.ask, "import_vllm_kvrag", lambda what: fake)
    ask = ["ask", "q?", "--index", root / "index", "--backend", "vllm", "--max-new-tokens", "2"]
    assert run(capsys, *ask)[0] == 0
    assert run(capsys, *ask, "--vllm-server", "http://127.0.0.1:9")[0] == 0
    assert calls[0]["enforce_eager"] is True and calls[0]["server"] is None
    assert "enforce_eager" not in calls[1] and calls[1]["server"] == "http://127.0.0.1:9"


def test_redis_store_from_the_command_line(setup, capsys):
    from redis_server import RedisServer

    root, model, docs = setup
    server = RedisServer()
    try:
        code, out, _ = run(
            capsys, "ingest", docs, "--index", root / "redis-index", "--model", model, "--quiet", "--redis", server.url
        )
        assert code == 0 and "KV encoded for 2" in out
        code, out, _ = run(
            capsys,
            "ask",
            "How many ships?",
            "--index",
            root / "redis-index",
            "--redis",
            server.url,
            "--json",
            "--max-new-tokens",
            "2",
        )
        stats = json.loads(out)["stats"]
        assert code == 0 and stats["store_hits"] == 2 and stats["chunks_encoded"] == 0
    finally:
        server.stop()
    code, _, err = run(capsys, "ask", "How many ships?", "--index", root / "redis-index", "--redis", server.url)
    assert code == 2 and "Start the server" in err and err.count("\n") == 1


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from kvrag.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    silent = [
        f"{name} {action.option_strings[0] if action.option_strings else action.dest}"
        for name, command in commands.items()
        for action in command._actions
        if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS and not action.help
    ]
    assert silent == []


def test_ingest_plans_aloud_refuses_a_huge_run_unless_told_and_prints_lines_in_a_log(tmp_path, capsys, monkeypatch):
    from tiny import save_tiny

    import kvrag.cli.index as index_cli

    model = save_tiny(tmp_path / "model")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"d{i}.txt").write_text(f"Record {i}: the harbour of town {i} holds {i + 3} ships and a mill.")
    monkeypatch.setattr(index_cli, "BIG_INGEST_CHUNKS", 5)
    argv = ["ingest", str(docs), "--index", str(tmp_path / "index"), "--model", str(model)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "12 new chunks to encode" in err and "nothing was written" in err and "--yes" in err
    assert not list((tmp_path / "index" / "kv").rglob("*.safetensors"))
    assert main([*argv, "--yes"]) == 0  # stderr is captured here, not a terminal: progress lines, no bar
    err = capsys.readouterr().err
    assert "kvrag: encoding 12 new chunks" in err and "kvrag: encoded 12 of 12 chunks (100%)" in err


def test_the_demo_runs_the_model_that_answers_and_the_135m_on_request(monkeypatch):
    from kvrag.lab import demo

    asked = []

    class Loaded(Exception):
        pass

    def from_pretrained(**load):
        asked.append(load["name_or_path"])
        raise Loaded

    monkeypatch.setattr(demo.KVModel, "from_pretrained", from_pretrained)
    for argv in (["demo"], ["demo", "--model", "smollm2-135m"]):
        with pytest.raises(Loaded):
            main(argv)
    assert asked == ["qwen2.5-coder-0.5b", "smollm2-135m"] and demo.DEMO_MODEL == "qwen2.5-coder-0.5b"


def test_the_footer_tells_chunks_read_for_their_run_from_those_retrieved():
    from kvrag.answer import Answer, AnswerStats, Source
    from kvrag.cli.ask import footer

    stats = AnswerStats.without_chunks("by_need", prompt_tokens=9, new_tokens=1, ttft_s=0.1, total_s=0.2)
    sources = [
        Source("d#0", "a", 0.5, read=True),
        Source("d#1", "b", 0.2, read=True, retrieved=False),  # its run's other chunk was retrieved
        Source("e#0", "c", 0.4),
        Source("d#2", "d", 0.1, retrieved=False),  # given for its run, not read
    ]
    lines = footer(Answer("x", [1], "eos", stats, sources=sources)).splitlines()
    assert lines[1:] == [
        "read: d#0, d#1",
        "read for their run, not retrieved: d#1",
        "retrieved, not read: e#0",
        "given for their run, not read: d#2",
    ]
