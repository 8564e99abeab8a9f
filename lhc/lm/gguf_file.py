"""Reading a llama.cpp GGUF file: its typed metadata and its tensors, memory-mapped.

A GGUF file (version 2 or 3, little-endian) is a header (magic ``GGUF``, version, tensor
and key/value counts), the key/value metadata (a key string, a value type, the value:
numbers, booleans, strings or arrays of them), a table of tensors (name, dimensions
fastest-varying first, ggml type, offset), then the tensor data from the next multiple
of ``general.alignment`` (32 by default).

``read_gguf(path)`` parses the metadata and the tensor table in one pass over a memory
map (a vocabulary of 262,144 strings reads in a fraction of a second, where the ``gguf``
package's reader builds a Python object per array element) and keeps the last files it
read, so the config, the weights, the tokenizer and the stop tokens of one checkpoint
read the file once. ``GGUFTensor.dequantize()`` gives a tensor as float32 in numpy
order (dimensions slowest-varying first), through llama.cpp's own
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import struct
from typing import Any

import gguf
import numpy as np

_MISSING = object()
# GGUF value types: struct format of the scalars (8: string, 9: array).
_SCALARS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9
_NUMPY = {code: np.dtype("<" + fmt) for code, fmt in _SCALARS.items()}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: its GGUF name (``blk.0.attn_q.weight``).
        shape: numpy order, slowest-varying first (GGUF's ``ne`` reversed).
        ggml_type: the ggml type's name (``"F32"``, ``"Q4_K"``, ...).
        data: its bytes, a ``uint8 [rows..., bytes per row]`` view of the memory map.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32, of ``shape``."""
        values = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.ggml_type])
        return np.asarray(values, np.float32).reshape(self.shape)


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensors.

    Attributes:
        path: where it was read from (for messages).
        metadata: key -> value (arrays as lists).
        tensors: name -> ``GGUFTensor``, in the file's order.
    """

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value of ``key``, else ``default``; ValueError naming the file and the key
        when it is missing and no default is given."""
        if key in self.metadata:
            return self.metadata[key]
        if default is _MISSING:
            raise ValueError(f"{self.path}: metadata key {key!r} is missing")
        return default


class _Cursor:
    """Little-endian values read one after another from a buffer."""

    def __init__(self, buffer, path: str):
        self.buffer, self.offset, self.path = buffer, 0, path

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start, self.offset = self.offset, self.offset + length
        if self.offset > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        return bytes(self.buffer[start : self.offset]).decode("utf-8")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.scalar("I"), self.scalar("Q")
        if item in _NUMPY:  # numbers: one read of the whole array
            dtype = _NUMPY[item]
            values = np.frombuffer(self.buffer, dtype, count, self.offset)
            self.offset += count * dtype.itemsize
            return values.tolist()
        return [self.value(item) for _ in range(count)]


def _read(path: str) -> GGUFFile:
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            handle.seek(0)
            raise ValueError(
                f"{path} is not a GGUF file: it starts with {handle.read(4)!r}, expected b'GGUF'"
            )
        if os.fstat(handle.fileno()).st_size < 24:
            raise ValueError(f"{path} is truncated or corrupt: shorter than a GGUF header")
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(memoryview(buffer), path)
    cursor.offset = 4
    try:
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise ValueError(
                f"GGUF version {version} (expected 2 or 3, little-endian; a big-endian file "
                "reads as a huge version)"
            )
        num_tensors, num_keys = cursor.scalar("Q"), cursor.scalar("Q")
        metadata = {}
        for _ in range(num_keys):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.scalar("Q") for _ in range(cursor.scalar("I"))]
            kind, offset = cursor.scalar("I"), cursor.scalar("Q")
            infos.append((name, dims, kind, offset))
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-cursor.offset // alignment) * alignment
        tensors = {}
        for name, dims, kind, offset in infos:
            ggml_type = gguf.GGMLQuantizationType(kind)
            block, size = gguf.GGML_QUANT_SIZES[ggml_type]
            if dims[0] % block:
                raise ValueError(f"tensor {name!r}: {dims[0]} values per row, blocks of {block}")
            row_bytes = dims[0] // block * size
            rows = math.prod(dims[1:])
            if start + offset + rows * row_bytes > len(buffer):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            data = np.frombuffer(buffer, np.uint8, rows * row_bytes, start + offset)
            shape = tuple(int(n) for n in reversed(dims))
            tensors[name] = GGUFTensor(
                name, shape, ggml_type.name, data.reshape(*shape[:-1], row_bytes)
            )
    except (struct.error, ValueError, UnicodeDecodeError, KeyError) as error:
        raise ValueError(f"{path} is truncated or corrupt: {error}") from error
    return GGUFFile(path, metadata, tensors)


@functools.lru_cache(maxsize=2)
def _cached(path: str, modified_ns: int, size: int) -> GGUFFile:
    return _read(path)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """The metadata and tensors of the GGUF file at ``path`` (the last two files read
    are kept, keyed by path, size and modification time).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not a GGUF file, another version or byte order, truncated or corrupt.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = os.stat(path)
    return _cached(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)
