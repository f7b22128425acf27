"""Building kvrag's C kernels: each library is compiled once per machine (its sources and headers, the flags and
the CPU's identity hashed) with the system's C compiler (`cc`, or `$CC`) into kvrag's cache folder, built in a
temporary folder and renamed (concurrent first builds are safe), and loaded with ctypes. It links the OpenMP
runtime torch already loaded, so its threads are torch's. Where there is no compiler that works, a library is
None and every kernel declines.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# Compiled with -ffast-math (the vector exp, reassociated sums) but linked without it: linked in, it would add
# a constructor that flushes subnormal floats to zero for the whole process.
COMPILE = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-c")
LINK = ("-shared", "-fopenmp")


def _cpu_id() -> str:
    """What the build depends on besides the source: the CPU's model and flags (-march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return platform.machine() + "\n".join(lines)


def build(name: str, sources: tuple[Path, ...]) -> ctypes.CDLL | None:
    """The shared library of `sources`, built once per machine (source, flags and CPU) into kvrag's cache folder
    and loaded; None where there is no compiler that works."""
    compiler = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not compiler or not all(s.exists() for s in sources) or platform.system() != "Linux":
        return None
    headers = sorted(sources[0].parent.glob("*.h"))  # what the sources include
    source = b"".join(s.read_bytes() for s in (*sources, *headers))
    digest = hashlib.sha256(source + " ".join(COMPILE + LINK).encode() + _cpu_id().encode()).hexdigest()[:16]
    from kvrag.files import default_cache_dir

    target = default_cache_dir() / "kernels" / f"{name}-{digest}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:  # built apart, renamed: concurrent builds
                built = Path(scratch) / target.name
                objects = [str(Path(scratch) / s.with_suffix(".o").name) for s in sources]
                for source_file, obj in zip(sources, objects):
                    subprocess.run(
                        [*compiler, *COMPILE, str(source_file), "-o", obj], check=True, capture_output=True, timeout=300
                    )
                subprocess.run(
                    [*compiler, *LINK, *objects, "-o", str(built), "-lm"], check=True, capture_output=True, timeout=120
                )
                os.replace(built, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):  # no compiler that works, a cache folder not writable, noexec
        return None
