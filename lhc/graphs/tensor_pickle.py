"""Reading pickled numpy arrays and torch tensors without running code from the file.

A pickle runs code only through the globals it names; ``load_tensor_pickle`` resolves
only those of numpy arrays and torch tensors (and refuses any other with a one-line
error naming it). Torch pickles a tensor's storage through
``torch.storage._load_from_bytes``, which would call ``torch.load`` without
``weights_only`` on bytes in the file: its storages are rebuilt here with numpy from the
``torch.save`` archive in those bytes (legacy or zip format), so tensors come back as
numpy arrays and torch is not needed.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from typing import Any, BinaryIO

import numpy as np

# numpy 2 renamed numpy.core to numpy._core; a pickle names whichever wrote it.
try:
    from numpy._core import multiarray as _multiarray
    from numpy._core import numeric as _numeric
except ImportError:  # numpy 1
    from numpy.core import multiarray as _multiarray
    from numpy.core import numeric as _numeric

# The globals a pickled numpy array names (the protocol decides which).
_NUMPY_GLOBALS = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
for _core in ("numpy.core", "numpy._core"):
    _NUMPY_GLOBALS[f"{_core}.multiarray", "_reconstruct"] = _multiarray._reconstruct
    _NUMPY_GLOBALS[f"{_core}.numeric", "_frombuffer"] = _numeric._frombuffer

# Element types of the storage classes torch pickles by name. Storage bytes are
# little-endian in torch's legacy format; its zip format records the byte order.
_STORAGE_DTYPES = {
    f"{name}Storage": np.dtype(code).newbyteorder("<")
    for name, code in {
        "Double": "f8", "Float": "f4", "Half": "f2", "Long": "i8", "Int": "i4",
        "Short": "i2", "Char": "i1", "Byte": "u1", "Bool": "?",
    }.items()
}  # fmt: skip

# What ``torch.save``'s legacy format pickles first: a magic number and a version.
_LEGACY_MAGIC, _LEGACY_PROTOCOL = 0x1950A86A20F9469CFC6C, 1001


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles a file, resolving only the globals in ``allowed``.

    Pickles run code only through the globals they name, so refusing every other
    global keeps a file from running code when read.

    Args:
      file: the binary stream to read.
      path: the file the stream came from, for error messages.
      allowed: ``(module, name)`` to the object that stands for it.
    """

    def __init__(self, file, path: str, allowed: dict[tuple[str, str], Any]):
        super().__init__(file)
        self.path = path
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise ValueError(
                f"{self.path}: refuses to load '{module}.{name}': not an array or a tensor"
            )
        return self.allowed[module, name]


class _TensorUnpickler(_RestrictedUnpickler):
    """Unpickles numpy arrays and torch tensors, the tensors as numpy arrays.

    Torch's own rebuild functions are replaced by numpy-only ones: the one for a
    storage would call ``torch.load`` without ``weights_only`` on bytes in the file.
    They are bound methods: a pickle can set attributes of a function it names (its
    defaults), not of a method.
    """

    def __init__(self, file, path: str):
        super().__init__(
            file,
            path,
            _NUMPY_GLOBALS
            | {
                ("torch._utils", "_rebuild_tensor"): self._rebuild_tensor,
                ("torch._utils", "_rebuild_tensor_v2"): self._rebuild_tensor,
                ("torch.storage", "_load_from_bytes"): self._load_storage,
                ("collections", "OrderedDict"): collections.OrderedDict,
                ("_codecs", "encode"): self._latin1_bytes,
                # Protocol 2 spells empty bytes as bytes() of Python 2's builtins.
                ("__builtin__", "bytes"): bytes,
                ("builtins", "bytes"): bytes,
            },
        )

    def _latin1_bytes(self, text: str, encoding: str) -> bytes:
        # Protocol 2 spells bytes as _codecs.encode(text, "latin1").
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise ValueError(f"{self.path}: expected bytes as latin1 text, got {encoding!r}")
        return text.encode("latin1")

    def _rebuild_tensor(self, storage, offset, size, stride, *unused) -> np.ndarray:
        """``torch._utils._rebuild_tensor_v2``: the tensor, copied out of its storage.

        The trailing arguments (``requires_grad``, backward hooks, metadata) mean
        nothing to a numpy array.
        """
        fits = (
            isinstance(storage, np.ndarray)
            and storage.ndim == 1
            and isinstance(size, tuple | list)
            and isinstance(stride, tuple | list)
            and len(size) == len(stride)
            and all(isinstance(value, int) and value >= 0 for value in (offset, *size, *stride))
        )
        # as_strided reads whatever memory the strides reach: keep them in the storage.
        if fits and 0 not in size:
            last = offset + sum((length - 1) * step for length, step in zip(size, stride))
            fits = last < len(storage)
        if not fits:
            raise ValueError(
                f"{self.path}: a tensor of size {size}, stride {stride} and offset {offset} "
                f"does not fit its storage"
            )
        storage = np.ascontiguousarray(storage)
        view = np.lib.stride_tricks.as_strided(
            storage[offset:],
            shape=size,
            strides=[step * storage.itemsize for step in stride],
            writeable=False,
        )
        return view.astype(storage.dtype.newbyteorder("="))  # a copy, in native order

    def _load_storage(self, data: bytes) -> np.ndarray:
        """``torch.storage._load_from_bytes``: the storage ``torch.save`` wrote to ``data``.

        Returns:
          The storage's elements, a 1-D array.
        """
        if not isinstance(data, bytes):
            raise ValueError(f"{self.path}: expected storage bytes, got {type(data).__name__}")
        if data.startswith(b"PK\x03\x04"):  # a zip's first record, as torch.load checks
            storage = self._zip_storage(data)
        else:
            storage = self._legacy_storage(data)
        if not isinstance(storage, np.ndarray):
            raise ValueError(f"{self.path}: expected a storage, got {type(storage).__name__}")
        return storage

    def _storage_unpickler(self, file, persistent_load) -> _RestrictedUnpickler:
        # Storage pickles name only their storage class; the data is kept apart.
        allowed = {("torch", name): dtype for name, dtype in _STORAGE_DTYPES.items()}
        unpickler = _RestrictedUnpickler(file, self.path, allowed)
        unpickler.persistent_load = persistent_load
        return unpickler

    def _storage_reference(self, saved_id: Any, fields: int) -> tuple[np.dtype, str, int]:
        # ("storage", storage class, key, location, numel[, view]) as torch saves it.
        if not (
            isinstance(saved_id, tuple)
            and len(saved_id) == fields
            and saved_id[0] == "storage"
            and isinstance(saved_id[1], np.dtype)
            and isinstance(saved_id[2], str)
            and isinstance(saved_id[4], int)
            and saved_id[4] >= 0
            and saved_id[5:] in ((), (None,))  # storage views: never written since torch 1.0
        ):
            raise ValueError(f"{self.path}: unexpected storage reference {saved_id!r:.100}")
        return saved_id[1], saved_id[2], saved_id[4]

    def _legacy_storage(self, data: bytes) -> Any:
        """Reads ``torch.save(..., _use_new_zipfile_serialization=False)`` output.

        Five pickles (magic number, version, system info, the object, its storage
        keys), then per key an int64 element count and the little-endian elements.
        """
        stream = io.BytesIO(data)
        magic, version, _ = (_RestrictedUnpickler(stream, self.path, {}).load() for _ in range(3))
        if (magic, version) != (_LEGACY_MAGIC, _LEGACY_PROTOCOL):
            raise ValueError(f"{self.path}: storage bytes are not a torch.save archive")
        storages = {}

        def persistent_load(saved_id):
            dtype, key, numel = self._storage_reference(saved_id, 6)
            if numel * dtype.itemsize > len(data):
                raise ValueError(f"{self.path}: storage {key} is larger than its bytes")
            # Filled below, once its bytes, which follow the pickles, are reached.
            return storages.setdefault(key, np.zeros(numel, dtype))

        result = self._storage_unpickler(stream, persistent_load).load()
        keys = _RestrictedUnpickler(stream, self.path, {}).load()
        if not isinstance(keys, list) or sorted(keys) != sorted(storages):
            raise ValueError(f"{self.path}: storage keys {keys!r:.100} do not match the pickle")
        for key in keys:
            storage = storages[key]
            numel = int.from_bytes(stream.read(8), "little")
            elements = stream.read(storage.nbytes)
            if numel != len(storage) or len(elements) != storage.nbytes:
                raise ValueError(f"{self.path}: storage {key} has the wrong number of bytes")
            storage[:] = np.frombuffer(elements, storage.dtype)
        return result

    def _zip_storage(self, data: bytes) -> Any:
        """Reads ``torch.save`` zip output: ``<archive>/data.pkl`` and ``<archive>/data/<key>``."""
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            # The archive's folder, as torch's reader finds it: that of the first record.
            prefix = names[0].split("/")[0] + "/" if names else ""
            if prefix + "data.pkl" not in names:
                raise ValueError(f"{self.path}: storage bytes are not a torch.save archive")
            byteorder = "little"  # what torch assumes when no record says
            if prefix + "byteorder" in names:
                byteorder = archive.read(prefix + "byteorder").decode()
            if byteorder not in ("little", "big"):
                raise ValueError(f"{self.path}: unknown byte order {byteorder!r:.20}")

            def persistent_load(saved_id):
                dtype, key, numel = self._storage_reference(saved_id, 5)
                name = f"{prefix}data/{key}"
                # Checked before reading, so a compressed record cannot blow up.
                if name not in names or archive.getinfo(name).file_size != numel * dtype.itemsize:
                    raise ValueError(f"{self.path}: storage {key} is missing or the wrong size")
                return np.frombuffer(archive.read(name), dtype.newbyteorder(byteorder))

            with archive.open(prefix + "data.pkl") as file:
                return self._storage_unpickler(file, persistent_load).load()


def load_tensor_pickle(file: BinaryIO, path: str) -> Any:
    """The object pickled in ``file``, its torch tensors as numpy arrays.

    Args:
      file: a binary stream positioned at the pickle.
      path: where it came from, for error messages.

    Raises:
      ValueError: a global other than an array's or a tensor's (the message names it),
        malformed storage bytes, or a tensor that does not fit its storage.
    """
    return _TensorUnpickler(file, path).load()
