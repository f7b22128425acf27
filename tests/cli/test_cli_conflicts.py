"""`kvrag ingest` into an existing index: a flag that disagrees with the index is an error naming both values."""

import shutil

import pytest
from tiny import HashEmbedder, edit_manifest, save_tiny

from kvrag.cli import main
from kvrag.engine.folder import IndexFolder


class NamedHashEmbedder(HashEmbedder):
    """HashEmbedder under a name, as a manifest records an embedder (and opening the index asks for it again)."""

    def __init__(self, name=None, device="cpu"):
        super().__init__(name or "hash-bag-of-words", device)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("conflicts")
    model = save_tiny(root / "model")
    docs = root / "docs"
    docs.mkdir()
    (docs / "ships.txt").write_text("The harbour of Velloria holds forty ships.")
    (docs / "mill.md").write_text("The mill of Brenn grinds barley.")
    return root, model, docs


@pytest.fixture
def index(setup, monkeypatch, capsys):
    """An index built with explicit, non-default settings (once; tests must leave it as it is)."""
    monkeypatch.setattr("kvrag.engine.rag.Embedder", NamedHashEmbedder)
    root, model, docs = setup
    index = root / "index"
    if not index.exists():
        code = main(
            ["ingest", str(docs), "--index", str(index), "--model", str(model), "--quiet"]
            + ["--chunk-tokens", "64", "--overlap", "8", "--dtype", "float32", "--storage-dtype", "bfloat16"]
            + ["--namespace", "tenant-a"]
        )
        assert code == 0, capsys.readouterr().err
        capsys.readouterr()
    return index


def ingest(capsys, setup, index, *flags):
    _, _, docs = setup
    code = main(["ingest", str(docs), "--index", str(index), "--quiet", *map(str, flags)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "flags, given, key, built",
    [
        (["--chunk-tokens", "100"], "--chunk-tokens 100", "chunk_tokens", "64"),
        (["--overlap", "20"], "--overlap 20", "overlap", "8"),
        (["--dtype", "bfloat16"], "--dtype bfloat16", "dtype", "float32"),
        (["--dtype", "fp16"], "--dtype fp16", "dtype", "float32"),
        (["--storage-dtype", "float16"], "--storage-dtype float16", "storage_dtype", "bfloat16"),
        (["--namespace", "tenant-b"], "--namespace tenant-b", "namespace", "tenant-a"),
        (["--namespace", ""], "--namespace ''", "namespace", "tenant-a"),
        (["--encoding", "alone"], "--encoding alone", "encoding", "document"),
        (
            ["--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
            "--model HuggingFaceTB/SmolLM2-135M-Instruct",
            "model",
            None,
        ),
    ],
)
def test_a_flag_that_conflicts_with_the_index_is_one_line_naming_both(capsys, setup, index, flags, given, key, built):
    before = {p.name: p.read_bytes() for p in index.rglob("*") if p.is_file()}
    code, out, err = ingest(capsys, setup, index, *flags)
    built = str(setup[1]) if built is None else built
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err == (
        f"kvrag: error: {given} conflicts with the index at {index}, built with {key} {built}: drop the flag or "
        "ingest into a new folder\n"
    )
    assert {p.name: p.read_bytes() for p in index.rglob("*") if p.is_file()} == before  # the index is unchanged


@pytest.mark.parametrize(
    "flags",
    [
        [],  # every flag at its default
        ["--dtype", "auto"],  # no preference
        ["--dtype", "fp32"],  # the index's dtype, by another name
        ["--chunk-tokens", "64", "--overlap", "8", "--dtype", "float32", "--storage-dtype", "bfloat16"],
        ["--namespace", "tenant-a"],
        ["--model", "{model}"],
        ["--model", "{model}/."],  # the same folder, written otherwise
    ],
)
def test_the_index_values_repeated_or_left_out_are_fine(capsys, setup, index, flags):
    manifest = IndexFolder(index).manifest()
    code, out, err = ingest(capsys, setup, index, *[f.format(model=setup[1]) for f in flags])
    assert code == 0 and "updated" in out and "already stored for 2" in out, err
    after = IndexFolder(index).manifest()
    for key in ("model", "dtype", "chunk_tokens", "overlap", "storage_dtype", "namespace"):
        assert after[key] == manifest[key]
    assert after["storage_dtype"] == "bfloat16" and after["namespace"] == "tenant-a"


def test_a_fresh_index_takes_the_defaults(capsys, setup, monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", NamedHashEmbedder)
    root, model, _ = setup
    fresh = root / "fresh"
    code, _, err = ingest(capsys, setup, fresh, "--model", model)
    manifest = IndexFolder(fresh).manifest()
    assert code == 0, err
    assert (manifest["chunk_tokens"], manifest["overlap"], manifest["storage_dtype"], manifest["namespace"]) == (
        200,
        20,
        "float16",
        "",
    )
    assert manifest["dtype"] == "float32" and manifest["model"] == str(model) and manifest["encoding"] == "document"
    code, _, err = ingest(capsys, setup, fresh, "--model", root / "other")
    assert code == 2 and f"--model {root / 'other'} conflicts" in err and f"built with model {model}:" in err


def test_an_index_of_the_embedded_default_model_conflicts_with_any_model_named(capsys, setup, index, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    edit_manifest(copy, model=None)
    code, _, err = ingest(capsys, setup, copy, "--model", setup[1])
    assert code == 2 and err == (
        f"kvrag: error: --model {setup[1]} conflicts with the index at {copy}, built with model None (the embedded "
        "default): drop the flag or ingest into a new folder\n"
    )


def test_an_index_built_before_encodings_keeps_its_chunks_alone(capsys, setup, index, tmp_path, monkeypatch):
    monkeypatch.setattr("kvrag.engine.rag.Embedder", NamedHashEmbedder)
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    manifest = IndexFolder(copy).manifest()
    edit_manifest(copy, encoding=...)  # as an index written before the field was
    code, _, err = ingest(capsys, setup, copy, "--encoding", "document")
    assert code == 2 and "--encoding document conflicts" in err and "built with encoding alone:" in err
    code, _, err = ingest(capsys, setup, copy)
    assert code == 0, err
    assert IndexFolder(copy).manifest()["encoding"] == "alone" and manifest["encoding"] == "document"


def test_the_help_states_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["ingest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    shipped = "default the model's choice (docs/models.md), float16 for a model kvrag does not name"
    for default in ("(default 200)", "(default 20)", shipped, "auto (default)", "default: none"):
        assert default in text


def test_the_header_of_a_new_index_is_the_flags_and_an_existing_one_keeps_its_own(capsys, setup, index, tmp_path,
                                                                                   monkeypatch):
    from kvrag.model.layout import CONTEXT_HEADER, DECLINING_HEADER

    monkeypatch.setattr("kvrag.engine.rag.Embedder", NamedHashEmbedder)
    before = {p.name: p.read_bytes() for p in index.rglob("*") if p.is_file()}
    code, out, err = ingest(capsys, setup, index, "--header", "declining")
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert "built under the header 'Answer the question using the documents below.\\n\\n', not" in err
    assert {p.name: p.read_bytes() for p in index.rglob("*") if p.is_file()} == before  # nothing written
    assert IndexFolder(index).manifest()["header"] == CONTEXT_HEADER
    fresh = tmp_path / "declining"
    code, _, err = ingest(capsys, setup, fresh, "--model", setup[1], "--header", "declining")
    assert code == 0, err
    assert IndexFolder(fresh).manifest()["header"] == DECLINING_HEADER
    code, _, err = ingest(capsys, setup, fresh)  # no flag: the index's own
    assert code == 0, err
    assert IndexFolder(fresh).manifest()["header"] == DECLINING_HEADER
    code, _, err = ingest(capsys, setup, fresh, "--header", "plain")
    assert code == 2 and "drop the header or ingest into a new folder" in err
