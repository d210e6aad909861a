"""Shared assertion for the quantized kernels' row-threshold dispatch (INT4 and INT8 AMX tests)."""
from __future__ import annotations

import torch


def assert_dispatch_by_rows(fused, members, x, old, new) -> None:
    """With the threshold at 4 rows: below it the fused and single linears give the outputs `old` bit for bit
    (torch's kernel's, or the AVX512 INT8 few-rows op's), from it up the tile op's outputs `new` (the ops called
    directly)."""
    for m in (1, 3):
        assert torch.equal(fused(x[:m]), torch.cat([o[:m] for o in old], dim=1))
        assert all(torch.equal(lin(x[:m]), o[:m]) for lin, o in zip(members, old))
    for m in (4, 17):
        assert torch.equal(fused(x[:m]), torch.cat([o[:m] for o in new], dim=1))
        assert all(torch.equal(lin(x[:m]), o[:m]) for lin, o in zip(members, new))
