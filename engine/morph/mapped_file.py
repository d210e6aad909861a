"""A safetensors file as tensors that are views of a private memory map (no copy on read).

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data, offsets relative to its start.
safetensors' own `get_tensor` returns a fresh tensor, and the host store then copied it onto the
target device: two copies of every layer per swap. Here the one copy is the caller's, straight from
the map into the memory the layer keeps (see HostStore.read). The map is released on close, so the
file's pages do not stay in this process's resident set.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BOOL": torch.bool}
_MAX_HEADER = 100 * 2**20  # as safetensors: a larger header is a corrupt file, not a big one


class MappedSafetensors:
    def __init__(self, path: Path | str):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ValueError(f"{self.path} is too short to be a safetensors file")
            # ACCESS_COPY: a private mapping torch can wrap writably; nothing is ever written through it.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (n,) = struct.unpack("<Q", self._map[:8])
        if n > min(_MAX_HEADER, size - 8):
            self.close()
            raise ValueError(f"{self.path}: header length {n} does not fit the file")
        header = json.loads(self._map[8:8 + n])
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict] = header
        self._data_start = 8 + n
        self._buffer = torch.frombuffer(self._map, dtype=torch.uint8) if size > self._data_start else None

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> torch.Tensor:
        """A view of the map (valid until close): copy what you keep."""
        e = self._entries[name]
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']}")
        begin, end = e["data_offsets"]
        shape = tuple(e["shape"])
        raw = self._buffer[self._data_start + begin:self._data_start + end]
        if raw.numel() != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{self.path}: tensor {name!r} offsets do not match its shape {shape}")
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        self._buffer = None  # the views must go before the map can close
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view: the map closes when it is collected
            pass

    def __enter__(self) -> "MappedSafetensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
