"""GGUF header parsing: `gguf.GGUFReader` made to report a truncated or corrupt file, and
faster on long token lists (used by checkpoints/gguf.py, which names the file in errors)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import struct

import numpy as np


class Truncated(Exception):
    """Raised inside the reader when a read would pass the end of the file."""


@functools.cache
def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


@functools.cache
def checked_reader_class(supported_types: tuple[str, ...]):
    """A GGUFReader that reports reads past the end of the file instead of mis-shaping arrays.

    Built lazily so importing this module does not import `gguf` (and numpy memmap machinery).
    """
    import gguf

    value_type = gguf.GGUFValueType
    u64 = np.dtype(np.uint64)
    read_u64 = struct.Struct("=Q").unpack_from  # host order: the fast path is for 'I' files only

    class CheckedReader(gguf.GGUFReader):
        where = "at the start"  # how far parsing got, for truncation messages

        def _cut(self, end: int) -> Truncated:
            return Truncated(f"the header is cut short {self.where}: reading it needs byte "
                              f"{end} but the file has {len(self.data)} bytes")

        def _get(self, offset, dtype, count=1, override_order=None):
            if type(self.data) is np.memmap:
                # A plain ndarray view of the same mapping: slicing a np.memmap runs Python-level
                # __array_finalize__ on every slice. Still zero-copy and lazy.
                self.data = self.data.view(np.ndarray)
            end = int(offset) + _itemsize(dtype) * int(count)
            if end > len(self.data):
                raise self._cut(end)
            return super()._get(offset, dtype, count, override_order)

        def _get_field_parts(self, orig_offs, raw_type):
            # The base class parses an array one element at a time through recursive calls,
            # which for a 49k-token vocabulary (tokens, merges, token types) takes most of the
            # load. Same parts, data indices and types, built in one pass: arrays of strings
            # and of scalars in host byte order; anything else goes to the base class.
            if raw_type != value_type.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n = int(raw_itype[0]), int(alen[0])
            offs = orig_offs + 12
            if itype == value_type.STRING:
                end, items = self._string_parts(offs, n)
                size = end - orig_offs
                data_idxs = list(range(3, 3 + 2 * n, 2))  # each string's bytes, after its length
            elif (nptype := self.gguf_scalar_to_np.get(itype)) is not None:
                values = self._get(offs, nptype, n)
                items = list(values.reshape(n, 1))  # one [1] view per element, like the base
                size = int(values.nbytes) + 12
                data_idxs = list(range(2, 2 + n))
            else:  # nested arrays, unknown item types: the base class (and its errors)
                return super()._get_field_parts(orig_offs, raw_type)
            # The base class learns the item type from the first element: none when empty.
            types = [value_type.ARRAY] + ([value_type(itype)] if n else [])
            return size, [raw_itype, alen, *items], data_idxs, types

        def _string_parts(self, offs: int, n: int) -> tuple[int, list]:
            """(end offset, [length (uint64 [1]), utf-8 bytes (uint8 [len])] per string), the
            parts as views of the file."""
            data = self.data
            size = len(data)
            buf = memoryview(data)
            parts = []
            append = parts.append
            for _ in range(n):
                start = offs + 8
                if start > size:
                    raise self._cut(start)
                end = start + read_u64(buf, offs)[0]
                if end > size:
                    raise self._cut(end)
                append(data[offs:start].view(u64))
                append(data[start:end])
                offs = end
            return offs, parts

        def _push_field(self, field, skip_sum=False):
            # The reader's own "GGUF.*" fields are the fixed header before the first key.
            self.where = ("before the first metadata key" if field.name.startswith("GGUF.")
                          else f"after metadata key {field.name!r}")
            return super()._push_field(field, skip_sum)

        def _build_tensor_info(self, offs, count):
            self.where = f"in the tensor table ({int(count)} tensors) after the metadata"
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs, fields):
            # Check each tensor's data range before the base class maps it, so the message can
            # name the tensor that the file's end cuts into.
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                except ValueError:
                    raise ValueError(f"tensor {name!r} has unknown type id {int(raw_type[0])}; "
                                     f"supported types: {', '.join(supported_types)}") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                # ggml packs each row into whole blocks; _dequantize's row joining relies on it.
                if len(dims) and int(dims[0]) % block:
                    raise ValueError(f"tensor {name!r} ({qtype.name}) has rows of {int(dims[0])} "
                                     f"elements, not a whole number of its {block}-element "
                                     "blocks; the file is corrupt")
                n_elems = int(np.prod(dims.astype(np.int64)))
                end = int(start_offs) + int(offset[0]) + n_elems * type_size // block
                if end > size:
                    raise Truncated(f"tensor {name!r} ({qtype.name}) needs bytes up to {end} "
                                     f"but the file ends at byte {size}")
            return super()._build_tensors(start_offs, fields)

    return CheckedReader


@functools.cache
def _madvise():
    """libc's madvise, or None where there is none (not Linux / no libc found)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return fn


def release_pages(array: np.ndarray) -> None:
    """Drop the whole pages under `array`, a view of a read-only file mapping (a tensor's
    bytes), from this process's resident memory once they are read: the file stays in the
    page cache, and a later read of the view faults them back in. Without it every tensor
    read stays resident until the reader is closed, which doubled a GGUF load's peak RSS (the
    file's pages beside the params made from them)."""
    madvise = _madvise()
    if madvise is None or not hasattr(mmap, "MADV_DONTNEED") or array.nbytes == 0:
        return
    page = mmap.PAGESIZE
    start = array.__array_interface__["data"][0]
    first, last = -(-start // page) * page, (start + array.nbytes) // page * page
    if last > first:
        madvise(first, last - first, mmap.MADV_DONTNEED)  # best effort: errors are ignored

