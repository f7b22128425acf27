"""Hostile values in an index manifest's fields each end in kvrag's own one-line error and exit 2, naming the field
and the folder: nothing they name is run, and no message suggests lowering a safety check. The index is built
unkeyed here (`--no-secret`): a keyed manifest cannot be edited without the key at all (tests/cache/test_secret.py)."""

import json

import pytest
import torch
from tiny import FACTS, edit_manifest, save_tiny

from kvrag.cli import main
from kvrag.engine.folder import MANIFEST
from kvrag.engine.rag import KVRAG
from kvrag.errors import IndexLoadError


class Planted:  # a class a pickle would have to import to load
    pass


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile-manifest")
    rag = KVRAG.from_defaults(root / "index", model=str(save_tiny(root / "model")), secret="")
    rag.ingest([text for text, _ in FACTS[:2]], progress=False)
    rag.persist()
    return root / "index"


def _hostile_folders(root):
    not_st = root / "not-st"
    not_st.mkdir()
    (not_st / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "os.system"}]))
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    torch.save({"weights": Planted()}, pickled / "pytorch_model.bin")
    return [str(not_st), str(pickled), "/etc", str(root / "nowhere")]


def test_every_hostile_embedder_is_one_line_naming_the_field(index, tmp_path, capsys):
    original = json.loads((index / MANIFEST).read_text())
    try:
        for embedder in _hostile_folders(tmp_path):
            edit_manifest(index, embedder=embedder)
            with pytest.raises(IndexLoadError, match="field 'embedder'") as caught:
                KVRAG.load(index, secret="")
            assert "weights_only=False" not in str(caught.value) and str(index) in str(caught.value)
            code = main(["info", "--index", str(index), "--no-secret"])
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("Loading weights")]
            assert code == 2 and len(err) == 1 and "field 'embedder'" in err[0], (embedder, err)
    finally:
        (index / MANIFEST).write_text(json.dumps(original))
