"""lhc.lm.gguf_file against llama.cpp's own reader (``gguf.GGUFReader``) on a file written
with ``gguf.GGUFWriter``: every metadata type, tensors of several ggml types."""

import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from lhc.lm.gguf_file import read_gguf

from ._gguf_files import _random_k_quant


def _write(path, rng):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -7)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -3000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**60)
    writer.add_int64("t.i64", -(2**60))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "Théo's café 🙂")
    writer.add_array("t.ints", [3, 1, 4, 1, 5])
    writer.add_array("t.floats", [0.5, -2.25])
    writer.add_array("t.strings", ["▁a", "", "<0x0A>", "日本"])
    tensors = {
        "f32": rng.normal(size=(3, 8)).astype(np.float32),
        "f16": rng.normal(size=(2, 4, 8)).astype(np.float16),
        "q8_0": gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), Q.Q8_0),
        "q4_k": _random_k_quant(2, 512, Q.Q4_K, rng),
    }
    for name, data in tensors.items():
        kind = {"f32": Q.F32, "f16": Q.F16, "q8_0": Q.Q8_0, "q4_k": Q.Q4_K}[name]
        writer.add_tensor(name, data, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_and_tensors_equal_llama_cpps_reader(tmp_path):
    path = _write(tmp_path / "all.gguf", np.random.default_rng(0))
    file = read_gguf(path)
    reference = gguf.GGUFReader(str(path))
    want = {
        key: field.contents()
        for key, field in reference.fields.items()
        if not key.startswith("GGUF.")  # the header, which the reader lists as fields
    }
    assert file.metadata.keys() == want.keys()
    for key, value in want.items():
        floats = key in ("t.f32", "t.f64", "t.floats")
        assert file.metadata[key] == (pytest.approx(value) if floats else value), key
    assert file.get("t.str") == "Théo's café 🙂" and file.get("t.strings")[3] == "日本"
    assert list(file.tensors) == [tensor.name for tensor in reference.tensors]
    for tensor in reference.tensors:
        got = file.tensors[tensor.name]
        assert got.shape == tuple(int(n) for n in reversed(tensor.shape))
        assert got.ggml_type == tensor.tensor_type.name
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(got.dequantize(), values.reshape(got.shape))


def test_one_read_per_file_version_and_clear_errors(tmp_path):
    rng = np.random.default_rng(1)
    path = _write(tmp_path / "model.gguf", rng)
    assert read_gguf(path) is read_gguf(str(path))  # read once
    first = read_gguf(path).tensors["f32"].dequantize().copy()
    os.replace(_write(tmp_path / "new.gguf", rng), path)  # replaced: new values, read again
    assert not np.array_equal(read_gguf(path).tensors["f32"].dequantize(), first)
    with pytest.raises(ValueError, match="model.gguf: metadata key 'nope' is missing"):
        read_gguf(path).get("nope")
    assert read_gguf(path).get("nope", 3) == 3
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(ValueError, match="short.gguf is truncated or corrupt"):
        read_gguf(tmp_path / "short.gguf")
    data = path.read_bytes()
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="v9.gguf is truncated or corrupt: GGUF version 9"):
        read_gguf(tmp_path / "v9.gguf")
    with pytest.raises(FileNotFoundError, match="no GGUF file at"):
        read_gguf(tmp_path / "missing.gguf")
