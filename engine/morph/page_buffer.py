"""Memory for a layer's weights straight from the OS, so a swap pays a copy and little else.

A layer installed by a swap or a restore lives in one anonymous mapping (`weight_buffer`), advised for
transparent huge pages:
- a fresh buffer is faulted in 2 MiB at a time instead of 4 KiB (SmolLM2, one thread: a fresh 7 MB
  tensor from the heap took 5-10 ms to fill, of which ~0.7 ms was the copy itself; from a huge-page
  mapping ~1.5-2.5 ms);
- dropping the layer unmaps it, so the resident set falls at once, with no malloc_trim (whose walk
  over the heap was ~0.7 ms of every swap).
The kernel never backs more than the mapping: huge pages only fill 2 MiB-aligned ranges wholly inside
it, so the resident bytes are the buffer's size rounded up to a 4 KiB page (what the ledger counts,
within a page). Tensors carved from the buffer keep it alive (torch.frombuffer holds the mapping).
"""
from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

ALIGN = 64  # bytes: oneDNN's and AVX-512's alignment for every tensor carved from a buffer


def aligned(nbytes: int, align: int = ALIGN) -> int:
    return -(-nbytes // align) * align


def weight_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] backed by its own anonymous mapping (huge pages where the kernel allows)."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere 4 KiB pages, still unmapped when dropped
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


def carve(sizes: Sequence[int]) -> list[torch.Tensor]:
    """One weight_buffer holding len(sizes) uint8 slices, each ALIGN-aligned, in order."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += aligned(n)
    buf = weight_buffer(total)
    return [buf[o:o + n] for o, n in zip(offsets, sizes)]


def typed(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A carved uint8 slice seen as `dtype` [shape] (its size must match exactly)."""
    return raw.view(dtype).view(tuple(shape))
