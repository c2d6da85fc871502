"""The header of a GGUF file (llama.cpp's format): its metadata and where its tensors are, read in one pass.

The `gguf` package's `GGUFReader` makes a numpy view per value, so SmolLM2's header (49,152 tokens and 48,900
merges) took it 4.2 s; this reads the same values with `struct` in a fraction of that (tests/convert/test_gguf.py
checks every value and tensor record against `GGUFReader`'s). Only the header's pages are read.

Layout (little-endian, versions 2 and 3): magic `GGUF`, version u32, tensor count u64, metadata count u64; each
metadata entry a key (string), a value type u32 and the value (an array: element type u32, count u64, elements;
a string: length u64, UTF-8 bytes); each tensor record a name, a dimension count u32, the dimensions u64 (ggml's
`ne`, fastest first), a ggml type u32 and an offset u64 from the start of the data, which begins at the first
multiple of `general.alignment` (default 32) after the records.
"""

import collections
import mmap
import struct

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# GGUF value types with a fixed size: struct format (little-endian).
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
DEFAULT_ALIGNMENT = 32

TensorRecord = collections.namedtuple("TensorRecord", ["name", "ggml_type", "dims", "offset"])
TensorRecord.__doc__ = """A tensor's record: `ggml_type` (int), `dims` (ggml's `ne`, tuple of ints, fastest first) and
`offset`, the tensor's first byte in the file."""

GGUFHeader = collections.namedtuple("GGUFHeader", ["version", "metadata", "tensors"])
GGUFHeader.__doc__ = """`metadata`: {key: Python value} (int, float, bool, str, or lists of them); `tensors`:
{name: `TensorRecord`} in the file's order."""


class _Cursor:
    def __init__(self, buffer, path, at):
        self.buffer, self.path, self.at = buffer, path, at

    def _take(self, size):
        """The offset of the next `size` bytes, which the cursor moves past."""
        if self.at + size > len(self.buffer):
            raise ValueError(f"{self.path} ends inside its GGUF header (at byte {self.at}): the file is truncated.")
        self.at += size
        return self.at - size

    def unpack_all(self, fmt):
        return struct.unpack_from(fmt, self.buffer, self._take(struct.calcsize(fmt)))

    def unpack(self, fmt):
        return self.unpack_all(fmt)[0]

    def string(self):
        length = self.unpack("<Q")
        start = self._take(length)
        return bytes(self.buffer[start:start + length]).decode("utf-8")

    def value(self, value_type, key):
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            element_type, count = self.unpack("<I"), self.unpack("<Q")
            if element_type in SCALARS:  # one unpack for the whole array
                return list(self.unpack_all(f"<{count}{SCALARS[element_type][1]}"))
            return [self.value(element_type, key) for _ in range(count)]
        if value_type not in SCALARS:
            raise ValueError(f"{self.path}: metadata {key!r} has the unknown GGUF value type {value_type}.")
        return self.unpack(SCALARS[value_type])


def read_header(path):
    """The `GGUFHeader` of the GGUF file at `path`: its version, metadata and tensor records."""
    with open(path, "rb") as handle:
        if handle.read(4) != MAGIC:
            raise ValueError(f"`path` must be a GGUF file (starting with b'GGUF'); {path!r} is not.")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _Cursor(buffer, path, at=len(MAGIC))
            version = cursor.unpack("<I")
            if version & 0xFFFF == 0:  # a version written big-endian
                raise ValueError(f"{path} is a big-endian GGUF file; only little-endian files are read.")
            if version not in VERSIONS:
                raise ValueError(f"{path} is GGUF version {version}; versions {list(VERSIONS)} are read.")
            tensor_count, metadata_count = cursor.unpack("<Q"), cursor.unpack("<Q")
            metadata = {}
            for _ in range(metadata_count):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.unpack("<I"), key)
            records = []
            for _ in range(tensor_count):
                name = cursor.string()
                dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
                records.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: `general.alignment` must be a power of two; it is {alignment!r}.")
    start = -(-cursor.at // alignment) * alignment  # the data: the first multiple of `alignment`
    tensors = {}
    for name, dims, ggml_type, offset in records:
        if name in tensors:
            raise ValueError(f"{path} holds two tensors named {name!r}.")
        tensors[name] = TensorRecord(name, ggml_type, dims, start + offset)
    return GGUFHeader(version, metadata, tensors)
