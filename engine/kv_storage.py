"""The KV tensor, block-major so that the highest block ids are one contiguous tail of memory:

    kv: [max_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]
          ^ committed [0, capacity)            reserved, not resident [capacity, max_blocks)

Only committed blocks cost memory:
- CPU: the whole max_blocks range is one anonymous mmap; pages never written are not resident,
  and shrinking hands the tail's pages back to the OS with madvise(MADV_DONTNEED), so RSS falls.
- CUDA: the tensor holds exactly `capacity` blocks; resizing reallocates and copies the kept ones.
  Views from layer() are therefore only valid until the next set_capacity(): re-read them per step.

A shrink moves live blocks from above the new top to free ids below it (`move_blocks`). On CPU, when a
block is a whole number of pages, that is a move of page-table entries (mremap with MREMAP_DONTUNMAP:
the source stays mapped, empty), not of bytes: SmolLM2, 100 blocks of 360 KiB, one thread, ~9 ms of
copying became well under 1 ms. Where the kernel refuses (before Linux 5.13, a run spanning two
mappings), that run is copied instead. Each moved run can split the KV range into up to 4 more
mappings; the process may hold only vm.max_map_count of them (65530 by default) and every other mmap
(torch's large allocations too) needs them, so the moves stop, and copies take over, once the splits
could reach an eighth of that limit.
"""
from __future__ import annotations

import ctypes
import functools
import mmap
import os

import torch


class KVStorage:
    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device, max_blocks: int, capacity: int):
        if not 0 <= capacity <= max_blocks:
            raise ValueError(f"need 0 <= capacity ({capacity}) <= max_blocks ({max_blocks})")
        self.num_layers, self.block_size = num_layers, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.max_blocks = max_blocks
        self.capacity = capacity
        self._block_shape = (num_layers, 2, block_size, num_kv_heads, head_dim)
        elem = torch.empty((), dtype=dtype).element_size()
        self.block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * elem
        self._mmap: mmap.mmap | None = None
        self._splits_left = _map_count_allowance()  # mappings the page moves may still create
        if self.device.type == "cpu":
            self.kv = self._reserve_cpu()
        else:
            self.kv = torch.empty((capacity, *self._block_shape), dtype=dtype, device=self.device)

    def _reserve_cpu(self) -> torch.Tensor:
        nbytes = max(self.max_blocks * self.block_bytes, 1)
        # Anonymous private mapping: address space only; the kernel backs a page on first write.
        self._mmap = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        flat = torch.frombuffer(self._mmap, dtype=torch.uint8)[: self.max_blocks * self.block_bytes]
        return flat.view(self.dtype).view(self.max_blocks, *self._block_shape)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [blocks, block_size, num_kv_heads, head_dim] (a view)."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]

    def copy_blocks(self, mapping: dict[int, int]) -> None:
        """Copy every layer's K and V of block src into block dst, for each src -> dst.

        A block is one contiguous run of memory (block-major layout), so each run of consecutive
        src -> consecutive dst ids is a single memcpy, straight from source to destination. (Advanced
        indexing, kv[dst] = kv[src], gathered into a temporary first: two copies; 100 live blocks of
        SmolLM2 took ~40 ms that way.)"""
        if not mapping:
            return
        if set(mapping.keys()) & set(mapping.values()):
            raise ValueError("copy_blocks needs disjoint source and destination ids")
        for src, dst, n in _runs(sorted(mapping.items())):
            self.kv[dst:dst + n].copy_(self.kv[src:src + n])

    def move_blocks(self, mapping: dict[int, int]) -> None:
        """Every layer's K and V of block src into block dst, for each src -> dst; the sources' contents
        are undefined afterwards (a shrink is about to release them)."""
        if not mapping:
            return
        if set(mapping.keys()) & set(mapping.values()):
            raise ValueError("move_blocks needs disjoint source and destination ids")
        movable = self._mmap is not None and self.block_bytes % mmap.PAGESIZE == 0 and _mremap() is not None
        base = self.kv.data_ptr()
        for src, dst, n in _runs(sorted(mapping.items())):
            if movable and self._splits_left >= _SPLITS_PER_MOVE and _move_pages(
                    base + src * self.block_bytes, base + dst * self.block_bytes, n * self.block_bytes):
                self._splits_left -= _SPLITS_PER_MOVE
            else:
                self.kv[dst:dst + n].copy_(self.kv[src:src + n])

    def set_capacity(self, new_capacity: int) -> None:
        """Commit blocks [0, new_capacity); blocks above it lose their contents."""
        if not 0 <= new_capacity <= self.max_blocks:
            raise ValueError(f"capacity must be in [0, {self.max_blocks}], got {new_capacity}")
        if self._mmap is not None:
            if new_capacity < self.capacity:
                self._release_cpu_tail(new_capacity, self.capacity)
        else:
            self._reallocate(new_capacity)
        self.capacity = new_capacity

    def _release_cpu_tail(self, start_block: int, end_block: int) -> None:
        # Round the start up: a page that still holds part of a kept block must stay.
        page = mmap.PAGESIZE
        start = -(-start_block * self.block_bytes // page) * page
        end = min(-(-end_block * self.block_bytes // page) * page, len(self._mmap))
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _reallocate(self, new_capacity: int) -> None:
        kept = min(self.capacity, new_capacity)
        new = torch.empty((new_capacity, *self._block_shape), dtype=self.dtype, device=self.device)
        new[:kept].copy_(self.kv[:kept])
        self.kv = new


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Sorted (src, dst) pairs -> (src, dst, length) runs where both ids advance by one."""
    runs: list[list[int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4
_SPLITS_PER_MOVE = 4  # a moved run splits the mappings at its source's and destination's two ends


def _map_count_allowance() -> int:
    """How many mappings page moves may add: an eighth of the kernel's per-process limit."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 8
    except (OSError, ValueError):
        return 0  # not Linux: no moves


@functools.cache
def _mremap():
    """libc's mremap, or None off Linux / glibc."""
    if not os.uname().sysname == "Linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mremap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return fn


def _move_pages(src: int, dst: int, nbytes: int) -> bool:
    """Move the pages of [src, src + nbytes) to dst (whatever was at dst is released); the source range
    stays mapped and reads as zeros. False when the kernel refuses (nothing changed then)."""
    flags = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
    return _mremap()(src, nbytes, nbytes, flags, dst) == dst
