"""The engine's GGUF reader (:mod:`engine.loader.gguf_reader`) against gguf-py's ``GGUFReader``.

Small files written by ``gguf.GGUFWriter`` (seeded tensors in F32/F16/Q8_0/Q4_1/I32, scalars of every
type, string and numeric arrays) must read the same through both; bad files (truncated in the header or
in the data, wrong magic or version, big-endian, duplicated tensors) must fail cleanly.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import quantize

from engine.loader.errors import ModelLoadError
from engine.loader.gguf_config import field_value
from engine.loader.gguf_file import open_gguf
from engine.loader.gguf_reader import MAX_KEPT_ARRAY_ITEMS, GgufFile

#: (key, value, type) of the scalars the sample file carries
SCALARS: list[tuple[str, object, GGUFValueType]] = [
    ("test.u8", 200, GGUFValueType.UINT8),
    ("test.i8", -100, GGUFValueType.INT8),
    ("test.u16", 60000, GGUFValueType.UINT16),
    ("test.i16", -30000, GGUFValueType.INT16),
    ("test.u32", 4_000_000_000, GGUFValueType.UINT32),
    ("test.i32", -2_000_000_000, GGUFValueType.INT32),
    ("test.f32", 0.25, GGUFValueType.FLOAT32),
    ("test.bool", True, GGUFValueType.BOOL),
    ("test.u64", 2**63 + 5, GGUFValueType.UINT64),
    ("test.i64", -(2**62), GGUFValueType.INT64),
    ("test.f64", 1e-300, GGUFValueType.FLOAT64),
    ("test.string", "héllo ✓", GGUFValueType.STRING),
]


def write_sample(path: Path, alignment: int | None = None, names: tuple[str, ...] = ()) -> None:
    """Write a small GGUF file with every kind of field and several tensor types (seeded).

    Args:
        path: where to write.
        alignment: ``general.alignment`` to set, or None for the default.
        names: extra names for small F32 tensors (to test duplicates).
    """
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    for key, value, kind in SCALARS:
        writer.add_key_value(key, value, kind)
    # a tokenizer-sized string array (the case the reader exists for), with non-ASCII and empty items
    writer.add_token_list([f"tok{i}".encode() for i in range(5000)] + ["ü", b""])
    writer.add_array("test.short_ints", [3, -1, 4, 1, -5])
    writer.add_key_value("test.short_u8", [1, 2, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    writer.add_array("test.short_bools", [True, False, True])
    writer.add_array("test.long_floats", [float(x) for x in rng.standard_normal(MAX_KEPT_ARRAY_ITEMS + 1)])
    writer.add_key_value(
        "test.long_u64", list(range(1000)), GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64
    )
    writer.add_string("test.after_arrays", "still read")
    f32 = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("a.f32", f32)
    writer.add_tensor("b.f32_1d", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("c.f16", rng.standard_normal((3, 32)).astype(np.float16))
    for name, qtype in (("d.q8_0", GGMLQuantizationType.Q8_0), ("e.q4_1", GGMLQuantizationType.Q4_1)):
        weights = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(name, quantize(weights, qtype), raw_dtype=qtype)
    writer.add_tensor("f.i32", rng.integers(-1000, 1000, (2, 5), dtype=np.int32))
    for name in names:
        writer.add_tensor(name, rng.standard_normal(4).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "sample.gguf"
    write_sample(path)
    return path


def assert_same_as_gguf(path: Path) -> GgufFile:
    """Check GgufFile against gguf's GGUFReader on ``path``; return ours."""
    ours, theirs = GgufFile(str(path)), gguf.GGUFReader(str(path))
    # gguf adds the header as pseudo-fields ("GGUF.version", ...)
    their_fields = {k: v for k, v in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(their_fields)
    for key, expected in their_fields.items():
        field = ours.fields[key]
        assert field.name == key
        if expected.types[0] == GGUFValueType.ARRAY:
            assert field.is_array and field.value is None, key
            assert (field.array_length, field.array_type) == (len(expected.data), expected.types[1]), key
            if field.values is not None:
                assert field.values == [expected.parts[i][0].item() for i in expected.data], key
        else:
            assert not field.is_array and (field.array_length, field.array_type) == (0, None), key
            assert field.value == expected.contents(), key
            assert type(field.value) is type(expected.contents()), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type, mine.name
        assert mine.shape.dtype == np.uint64 and mine.shape.tolist() == ref.shape.tolist(), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            ref.n_elements, ref.n_bytes, ref.data_offset
        ), mine.name  # fmt: skip
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape, mine.name
        assert np.array_equal(mine.data, ref.data), mine.name
        assert mine.data_offset % ours.alignment == 0
    return ours


def test_matches_gguf_reader(sample: Path) -> None:
    ours = assert_same_as_gguf(sample)
    assert ours.version == 3 and ours.alignment == 32
    for key, value, _ in SCALARS:
        got = field_value(ours.fields[key])
        assert got == pytest.approx(value) if isinstance(value, float) else got == value, key
    assert field_value(ours.fields["test.after_arrays"]) == "still read"
    assert ours.fields["tokenizer.ggml.tokens"].array_length == 5002
    # short numeric arrays keep their values, long ones and string arrays do not
    assert ours.fields["test.short_ints"].values == [3, -1, 4, 1, -5]
    assert ours.fields["test.short_u8"].values == [1, 2, 255]
    assert ours.fields["test.short_bools"].values == [True, False, True]
    assert ours.fields["test.long_floats"].values is None
    assert ours.fields["test.long_u64"].values is None
    assert ours.fields["tokenizer.ggml.tokens"].values is None
    with pytest.raises(ModelLoadError, match="is an array"):
        field_value(ours.fields["tokenizer.ggml.tokens"])
    types = {t.name: t.tensor_type for t in ours.tensors}
    assert types["d.q8_0"] == GGMLQuantizationType.Q8_0 and types["e.q4_1"] == GGMLQuantizationType.Q4_1
    # the data are views of the file, not copies
    assert not ours.tensors[0].data.flags.writeable


def test_custom_alignment(tmp_path: Path) -> None:
    path = tmp_path / "aligned.gguf"
    write_sample(path, alignment=64)
    assert assert_same_as_gguf(path).alignment == 64


def test_nested_array_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "nested.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.nested", [[1, 2], [3, 4, 5]])
    writer.add_uint32("test.after", 7)
    writer.add_tensor("w", np.ones((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = GgufFile(str(path))
    nested = ours.fields["test.nested"]
    assert (nested.array_type, nested.array_length, nested.values) == (GGUFValueType.ARRAY, 2, None)
    assert ours.fields["test.after"].value == 7
    assert np.array_equal(ours.tensors[0].data, np.ones((2, 2), dtype=np.float32))


def test_truncated_files(sample: Path, tmp_path: Path) -> None:
    data = sample.read_bytes()
    header_end = GgufFile(str(sample)).data_start
    # cuts: in the fixed header, in the key/values (inside the token strings), in the tensor infos,
    # and in the tensor data
    for cut in (0, 3, 20, 200, 30_000, header_end - 10, len(data) - 100):
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated|corrupt") as err:
            open_gguf(str(truncated))
        assert truncated.name in str(err.value)


@pytest.mark.parametrize(
    "patch,message",
    [
        (lambda d: b"GGUX" + d[4:], "not a GGUF file"),
        (lambda d: d[:4] + struct.pack("<I", 1) + d[8:], "unsupported GGUF version 1"),
        (lambda d: d[:4] + struct.pack(">I", 3) + d[8:], "big-endian"),
        # a tensor count the file cannot hold
        (lambda d: d[:8] + struct.pack("<Q", 2**40) + d[16:], "past the end"),
    ],
    ids=["magic", "version", "big-endian", "tensor-count"],
)
def test_bad_headers(sample: Path, tmp_path: Path, patch, message: str) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patch(sample.read_bytes()))
    with pytest.raises(ValueError, match=message):
        GgufFile(str(bad))
    with pytest.raises(ModelLoadError, match="corrupt"):
        open_gguf(str(bad))


def test_duplicated_tensor_names(tmp_path: Path) -> None:
    path = tmp_path / "dup.gguf"
    write_sample(path, names=("x.one", "x.two"))
    # same length, so only the name changes: the two infos now share a name
    path.write_bytes(path.read_bytes().replace(b"x.two", b"x.one"))
    with pytest.raises(ValueError, match="duplicated tensor name 'x.one'"):
        GgufFile(str(path))
    with pytest.raises(ModelLoadError, match="corrupt"):
        open_gguf(str(path))
