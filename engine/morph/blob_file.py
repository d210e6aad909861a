"""A file of tensors laid out exactly as a layer holds them in memory, read as views of a private map.

    8 bytes  b"MSBLOBS1"
    8 bytes  header length N, little-endian
    N bytes  JSON {"tensors": {name: {"dtype", "shape", "offset"}}, "metadata": {str: str}}
    padding to a 4 KiB page, then the data in runs: each run at a 64-byte aligned offset (oneDNN's and
    AVX-512's alignment), its tensors back to back (a fused group's members tile one tensor)

Why not safetensors: it aligns data to 8 bytes only and orders tensors by name, so its views can
neither feed oneDNN's packed weights nor tile a fused group. Here the views ARE the layer's memory:
mapped from the page cache (no copy, no zeroed pages), kept alive by the tensors that view them
(torch.frombuffer holds the map) and unmapped when the last one is dropped. They count in the
process's resident set like any weight (the ledger counts them as the layer's bytes). A file is never
changed in place once written (writers use a temporary name and rename), so a live map stays valid.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

MAGIC = b"MSBLOBS1"
ALIGN = 64
_PAGE = 4096
_MADV_POPULATE_READ = 22  # Linux 5.14+: map the file's cached pages now, one call instead of a fault each


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def write_blobs(path: Path, runs: list[list[tuple[str, torch.Tensor]]], metadata: dict[str, str]) -> None:
    """Write the tensors of `runs` and `metadata` to `path` atomically (a temporary file, then rename).
    Each run starts 64-byte aligned and its tensors follow each other with no gap (a fused group)."""
    entries, offset = {}, 0
    for run in runs:
        offset = _aligned(offset, ALIGN)
        for name, t in run:
            entries[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
            offset += t.numel() * t.element_size()
    header = json.dumps({"tensors": entries, "metadata": metadata}).encode()
    data_start = _aligned(16 + len(header), _PAGE)
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for run in runs:
            for name, t in run:
                f.seek(data_start + entries[name]["offset"])
                f.write(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        f.truncate(data_start + offset)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class MappedBlobs:
    """An opened blob file: `tensor(name)` is a view of the map (no copy); the map lives while views do."""

    def __init__(self, path: Path | str, populate: bool = True):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise ValueError(f"{self.path} is not a blob file")
            (n,) = struct.unpack("<Q", head[8:])
            header = json.loads(f.read(n))
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writes never reach the file
        self.metadata: dict[str, str] = header["metadata"]
        self._entries: dict[str, dict] = header["tensors"]
        self._data_start = _aligned(16 + n, _PAGE)
        if populate:
            try:
                self._map.madvise(_MADV_POPULATE_READ)
            except OSError:  # older kernel: pages fault in on first use instead
                pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        dtype = getattr(torch, e["dtype"])
        shape = tuple(e["shape"])
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        begin = self._data_start + e["offset"]
        if begin + nbytes > self._bytes.numel():
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        return self._bytes[begin:begin + nbytes].view(dtype).view(shape)
