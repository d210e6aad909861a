"""Shared assertion for the quantized kernels' row-threshold dispatch (INT4 and INT8 AMX tests)."""
from __future__ import annotations

import torch


def assert_dispatch_by_rows(fused, members, x, old, new) -> None:
    """With the threshold at 4 rows: below it the fused and single linears give torch's kernel's
    outputs `old` bit for bit, from it up the AMX op's outputs `new` (the op called directly)."""
    for m in (1, 3):
        assert torch.equal(fused(x[:m]), torch.cat([o[:m] for o in old], dim=1))
        assert all(torch.equal(lin(x[:m]), o[:m]) for lin, o in zip(members, old))
    for m in (4, 17):
        assert torch.equal(fused(x[:m]), torch.cat([o[:m] for o in new], dim=1))
        assert all(torch.equal(lin(x[:m]), o[:m]) for lin, o in zip(members, new))
