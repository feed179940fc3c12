"""Reading and writing IDX files (the MNIST container format), gzip-compressed or raw.

An IDX file is a 4-byte magic ``00 00 <type> <ndim>``, then ``ndim`` big-endian uint32 dimensions, then the
payload in C order.  Only the unsigned-byte type (``0x08``) with 1 dimension (labels, magic ``0x00000801``) or
3 dimensions (images, magic ``0x00000803``) is accepted: that is all MNIST uses, and anything else is far more
likely a wrong or corrupt file than a genuine exotic IDX file.
"""

from __future__ import annotations

import gzip as gzip_module
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..io import atomic_write

__all__ = ["read_idx", "write_idx", "read_maybe_gzipped", "array_after_header", "GZIP_MAGIC", "IDX_UBYTE",
           "LABELS_MAGIC", "IMAGES_MAGIC"]

GZIP_MAGIC = b"\x1f\x8b"
IDX_UBYTE = 0x08
LABELS_MAGIC = 0x00000801
IMAGES_MAGIC = 0x00000803
_SUPPORTED_NDIM = (1, 3)


def read_maybe_gzipped(path: Path) -> bytes:
    """The file's decoded bytes: gunzipped when it starts with the gzip magic (whatever its name says)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] != GZIP_MAGIC:
        return raw
    try:
        # gzip.decompress also rejects bytes after the last member ("not a gzipped file") and a cut stream (EOFError)
        return gzip_module.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: corrupt gzip stream: {e}") from None


def read_idx(path: str | os.PathLike, ndim: int | None = None) -> np.ndarray:
    """Read an unsigned-byte IDX file (gzip or raw, told by the magic bytes ``1f 8b``, not the name) into a
    ``uint8`` array of the header's shape; ``ndim``, if given, is the number of dimensions the file must have (1 for
    labels, 3 for images).  A DataError, one line naming the file, for a missing/unreadable file, a bad gzip
    stream, a wrong magic, type or dimension count, or a payload shorter or longer than the header says."""
    path = Path(path)
    data = read_maybe_gzipped(path)
    if len(data) < 4:
        raise DataError(f"{path}: truncated: {len(data)} bytes, too short for the 4-byte IDX magic")
    magic, dtype_code, file_ndim = struct.unpack(">I", data[:4])[0], data[2], data[3]
    if data[:2] != b"\x00\x00" or file_ndim not in _SUPPORTED_NDIM:
        raise DataError(f"{path}: bad magic 0x{magic:08x} (expected 0x{LABELS_MAGIC:08x} for labels or "
                        f"0x{IMAGES_MAGIC:08x} for images); not an IDX file of the MNIST kind")
    if dtype_code != IDX_UBYTE:
        raise DataError(f"{path}: unsupported IDX data type 0x{dtype_code:02x} (only unsigned byte 0x08)")
    if ndim is not None and file_ndim != ndim:
        raise DataError(f"{path}: expected a {ndim}-dimensional IDX file (magic 0x{0x800 + ndim:08x}), "
                        f"found {file_ndim} dimensions (magic 0x{magic:08x})")
    header_len = 4 + 4 * file_ndim
    if len(data) < header_len:
        raise DataError(f"{path}: truncated: header needs {header_len} bytes, found {len(data)}")
    return array_after_header(path, data, header_len, struct.unpack(f">{file_ndim}I", data[4:header_len]))


def array_after_header(path: Path, data: bytes, offset: int, shape: tuple, dtype=np.dtype(np.uint8)) -> np.ndarray:
    """The ``shape`` array of ``dtype`` filling ``data`` (the bytes of ``path``) from byte ``offset`` on; a one-line
    DataError naming the file when the payload is shorter or longer than ``shape`` says."""
    expected, found = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, len(data) - offset
    if found != expected:
        what = "truncated" if found < expected else f"{found - expected} trailing bytes"
        raise DataError(f"{path}: {what}: the header's shape {tuple(shape)} of {dtype} needs {expected} bytes of "
                        f"data, found {found}")
    # a copy: np.frombuffer over bytes is read-only, and torch.from_numpy on it would warn
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape).copy()


def write_idx(path: str | os.PathLike, array, gzip: bool = True) -> Path:
    """Write a ``uint8`` array with 1 or 3 dimensions as an IDX file (gzip-compressed by default), atomically.

    The gzip header carries mtime 0 so the same array always gives the same bytes.
    """
    arr = np.asarray(array)
    if arr.dtype != np.uint8:
        raise ValueError(f"write_idx: {path}: array must be uint8, got {arr.dtype}")
    if arr.ndim not in _SUPPORTED_NDIM:
        raise ValueError(f"write_idx: {path}: array must have 1 or 3 dimensions, got shape {arr.shape}")
    header = bytes([0, 0, IDX_UBYTE, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    payload = header + np.ascontiguousarray(arr).tobytes()
    if gzip:
        payload = gzip_module.compress(payload, mtime=0)
    return atomic_write(path, lambda f: f.write(payload))
