"""A fast reader for GGUF files (llama.cpp's format): metadata, tensor infos and memory-mapped tensor data.

Why not ``gguf.GGUFReader``: it builds a numpy view for every element of every metadata array, which for
a tokenizer's ~100k token strings (and as many merges) costs seconds per open. This reader decodes
scalars, keeps the values of short numeric arrays only, and skips over everything else in an array
(string arrays by walking their length prefixes, numeric arrays in one step of ``count * itemsize``).
Tensor data are numpy views into one read-only memory map of the file, with the dtype and shape
conventions of ``gguf.ReaderTensor.data``.

Layout (little-endian; see ggml's ``docs/gguf.md``)::

    magic "GGUF" | version u32 | tensor count u64 | kv count u64
    kv pairs:     key (u64 length + utf-8) | value type u32 | value
                  (string: u64 length + utf-8; array: item type u32 + count u64 + items)
    tensor infos: name (string) | n_dims u32 | dims u64 x n_dims | ggml type u32 | offset u64
    padding to ``general.alignment`` (default 32), then the tensor data (offsets relative to its start)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: numeric arrays up to this many items keep their values (rope factors, per-layer sizes); longer ones
#: (token types, scores) are skipped, nothing in the loader reads them
MAX_KEPT_ARRAY_ITEMS = 64
#: nested arrays deeper than this are treated as corrupt rather than recursed into
MAX_ARRAY_DEPTH = 8
#: ggml lists at most 4 dimensions; a larger count is a corrupt file, not a tensor
MAX_DIMS = 8

#: scalar value type -> struct format (little-endian)
SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
SCALAR_SIZES: dict[GGUFValueType, int] = {kind: struct.calcsize(fmt) for kind, fmt in SCALAR_FORMATS.items()}

#: tensor types whose data gguf's reader exposes typed (all others are raw block bytes, uint8)
TYPED_DTYPES: dict[GGMLQuantizationType, np.dtype[Any]] = {
    GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F32: np.dtype("<f4"),
    GGMLQuantizationType.F64: np.dtype("<f8"),
    GGMLQuantizationType.I8: np.dtype("<i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"),
    GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_HEADER = struct.Struct("<4sIQQ")


@dataclass(slots=True)
class GgufField:
    """One metadata key/value pair.

    Attributes:
        name: the key (``general.architecture``, ``llama.block_count``, ...).
        value: the decoded scalar or string; None for arrays.
        is_array: the value is an array.
        array_length: number of items of an array, 0 for scalars.
        array_type: item type of an array, None for scalars.
        values: the items of a numeric array of at most :data:`MAX_KEPT_ARRAY_ITEMS`; None otherwise
            (scalars, string arrays, nested arrays, longer arrays).
    """

    name: str
    value: str | int | float | bool | None
    is_array: bool = False
    array_length: int = 0
    array_type: GGUFValueType | None = None
    values: list[int | float | bool] | None = None


@dataclass(slots=True)
class GgufTensor:
    """One tensor: its info record and a view of its bytes in the file's memory map.

    Attributes:
        name: the tensor's name in the file.
        tensor_type: its ggml type.
        shape: dimensions in ggml order (innermost first), ``uint64``.
        n_elements: product of the dimensions.
        n_bytes: bytes of data (blocks for quantized types).
        data_offset: absolute file offset of the data.
        data: read-only view of the data: typed with shape ``reversed(shape)`` for F16/F32/F64/I8/I16/I32/
            I64, otherwise ``uint8`` with ``quant_shape_to_byte_shape(reversed(shape), tensor_type)``.
    """

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every read past the end raises ValueError."""

    __slots__ = ("buf", "pos", "size")

    def __init__(self, buf: memoryview, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos
        self.size = len(buf)

    def need(self, n: int, what: str) -> None:
        """Raise unless ``n`` more bytes are left.

        Raises:
            ValueError: the file ends first (truncated, or a corrupt length).
        """
        if n < 0 or self.pos + n > self.size:
            raise ValueError(
                f"{what} at byte {self.pos} needs {n} bytes, past the end of the file ({self.size} bytes)"
            )

    def u32(self) -> int:
        """Read a u32 (struct.error past the end)."""
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self) -> int:
        """Read a u64 (struct.error past the end)."""
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def string(self, what: str) -> str:
        """Read a u64-length-prefixed utf-8 string.

        Raises:
            ValueError: the string runs past the end of the file or is not utf-8.
        """
        length = self.u64()
        # memoryview slicing silently stops at the end: check first so a cut string is an error
        self.need(length, what)
        start = self.pos
        self.pos += length
        return str(self.buf[start : self.pos], "utf-8")

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` length-prefixed strings without decoding them.

        Raises:
            ValueError: a string runs past the end of the file.
        """
        # each string is at least its 8-byte length: a count the file cannot hold is corrupt, and this
        # rejects it before looping
        self.need(count * 8, what)
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8 + length
            if pos > size:
                self.pos = pos - length
                self.need(length, what)
        self.pos = pos


class GgufFile:
    """A parsed GGUF file: metadata fields, tensor infos and memory-mapped tensor data.

    Attributes:
        path: the file.
        version: the GGUF version (2 or 3).
        fields: metadata by key, in file order.
        tensors: tensor infos and data views, in file order.
        alignment: the data alignment (``general.alignment``, default 32).
        data_start: absolute offset of the tensor data section.
    """

    def __init__(self, path: str) -> None:
        """Parse ``path``'s header and map its data.

        Args:
            path: the ``.gguf`` file.

        Raises:
            ValueError: not a GGUF file, an unsupported version, a big-endian file, a truncated or
                corrupt header, duplicated tensor names, or tensor data past the end of the file
                (``UnicodeDecodeError``, a ValueError, for keys or strings that are not utf-8).
            struct.error: the file ends inside a fixed-size value.
            OSError: the file cannot be opened (an empty file cannot be mapped: ValueError).
        """
        self.path = path
        # one read-only map for the header and every tensor's data view; a plain ndarray view of it
        # (not np.memmap) keeps per-tensor slicing cheap, and its base keeps the map alive
        self._bytes: np.ndarray = np.memmap(path, mode="r", dtype=np.uint8).view(np.ndarray)
        self.fields: dict[str, GgufField] = {}
        self.tensors: list[GgufTensor] = []
        with memoryview(self._bytes) as buf:
            cursor = _Cursor(buf)
            self.version, n_tensors, n_fields = self._read_header(cursor)
            # every field is at least its key length, value type and a 1-byte value; every tensor info
            # its name length, n_dims, type and offset: counts the file cannot hold are corrupt
            cursor.need(n_fields * 13 + n_tensors * 24, "metadata and tensor infos")
            for _ in range(n_fields):
                found = self._read_field(cursor)
                self.fields[found.name] = found
            infos = [self._read_tensor_info(cursor) for _ in range(n_tensors)]
            header_end = cursor.pos
        self.alignment = self._alignment()
        self.data_start = -(-header_end // self.alignment) * self.alignment
        names: set[str] = set()
        for name, dims, tensor_type, offset in infos:
            if name in names:
                raise ValueError(f"duplicated tensor name '{name}'")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, tensor_type, offset))

    @staticmethod
    def _read_header(cursor: _Cursor) -> tuple[int, int, int]:
        """Read magic, version and counts.

        Returns:
            (version, tensor count, metadata count).

        Raises:
            ValueError: wrong magic, a big-endian file or an unsupported version.
            struct.error: the file is shorter than the header.
        """
        magic, version, n_tensors, n_fields = _HEADER.unpack_from(cursor.buf, 0)
        cursor.pos = _HEADER.size
        if magic != MAGIC:
            raise ValueError(f"not a GGUF file (magic {bytes(magic)!r}, expected {MAGIC!r})")
        # a big-endian file's version reads little-endian as version << 24: the low half is zero
        if version & 0xFFFF == 0 and version >> 24 in SUPPORTED_VERSIONS:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
        return version, n_tensors, n_fields

    def _read_field(self, cursor: _Cursor) -> GgufField:
        """Read one key/value pair.

        Raises:
            ValueError: an unknown value type, or a value past the end of the file.
            struct.error: the file ends inside a fixed-size value.
        """
        name = cursor.string("metadata key")
        kind = GGUFValueType(cursor.u32())
        if kind != GGUFValueType.ARRAY:
            return GgufField(name, self._read_scalar(cursor, kind, name))
        item_type = GGUFValueType(cursor.u32())
        length = cursor.u64()
        values = self._read_array(cursor, item_type, length, name, depth=1)
        return GgufField(name, None, True, length, item_type, values)

    @staticmethod
    def _read_scalar(cursor: _Cursor, kind: GGUFValueType, name: str) -> str | int | float | bool:
        """Read a scalar or string value of type ``kind``."""
        if kind == GGUFValueType.STRING:
            return cursor.string(f"value of '{name}'")
        fmt = SCALAR_FORMATS[kind]
        (value,) = struct.unpack_from(fmt, cursor.buf, cursor.pos)
        cursor.pos += SCALAR_SIZES[kind]
        return value  # type: ignore[no-any-return]

    def _read_array(
        self, cursor: _Cursor, item_type: GGUFValueType, length: int, name: str, depth: int
    ) -> list[int | float | bool] | None:
        """Read (short numeric arrays) or skip (everything else) an array's items.

        Returns:
            The items of a numeric array of at most :data:`MAX_KEPT_ARRAY_ITEMS`, else None.

        Raises:
            ValueError: items past the end of the file, an unknown item type, or nesting deeper than
                :data:`MAX_ARRAY_DEPTH`.
        """
        what = f"array '{name}'"
        if item_type == GGUFValueType.STRING:
            cursor.skip_strings(length, what)
            return None
        if item_type == GGUFValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
            cursor.need(length * 12, what)  # each inner array is at least its type and count
            for _ in range(length):
                inner = GGUFValueType(cursor.u32())
                self._read_array(cursor, inner, cursor.u64(), name, depth + 1)
            return None
        size = SCALAR_SIZES[item_type]
        cursor.need(length * size, what)
        values: list[int | float | bool] | None = None
        if length <= MAX_KEPT_ARRAY_ITEMS:
            values = list(struct.unpack_from(f"<{length}{SCALAR_FORMATS[item_type][1]}", cursor.buf, cursor.pos))
        cursor.pos += length * size
        return values

    @staticmethod
    def _read_tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        """Read one tensor info record.

        Returns:
            (name, dims in ggml order, type, data offset relative to the data section).

        Raises:
            ValueError: too many dimensions, an unknown type, or a record past the end of the file.
            struct.error: the file ends inside a fixed-size value.
        """
        name = cursor.string("tensor name")
        n_dims = cursor.u32()
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor '{name}' has {n_dims} dimensions (corrupt tensor info)")
        dims = struct.unpack_from(f"<{n_dims}Q", cursor.buf, cursor.pos)
        cursor.pos += 8 * n_dims
        tensor_type = GGMLQuantizationType(cursor.u32())
        offset = cursor.u64()
        return name, dims, tensor_type, offset

    def _alignment(self) -> int:
        """The data alignment: ``general.alignment`` if the file sets it, else 32.

        Raises:
            ValueError: an alignment that is not a positive integer.
        """
        found = self.fields.get("general.alignment")
        if found is None:
            return DEFAULT_ALIGNMENT
        value = found.value
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"invalid general.alignment {value!r}")
        return value

    def _tensor(
        self, name: str, dims: tuple[int, ...], tensor_type: GGMLQuantizationType, offset: int
    ) -> GgufTensor:
        """Build a tensor record and its data view.

        Raises:
            ValueError: the data run past the end of the file, or a row that is not whole blocks.
        """
        n_elements = 1
        for dim in dims:
            n_elements *= dim
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * type_size // block_size
        start = self.data_start + offset
        end = start + n_bytes
        if end > self._bytes.size:
            raise ValueError(
                f"tensor '{name}' (bytes {start}..{end}) runs past the end of the file ({self._bytes.size} bytes)"
            )
        raw = self._bytes[start:end]
        np_dims = tuple(reversed(dims))
        dtype = TYPED_DTYPES.get(tensor_type)
        if dtype is not None:
            data = raw.view(dtype).reshape(np_dims)
        else:
            data = raw.reshape(quant_shape_to_byte_shape(np_dims, tensor_type))
        return GgufTensor(
            name=name,
            tensor_type=tensor_type,
            shape=np.array(dims, dtype=np.uint64),
            n_elements=n_elements,
            n_bytes=n_bytes,
            data_offset=start,
            data=data,
        )
