"""Full-precision linears with pre-packed (oneDNN blocked) weights, still swappable.

F.linear on a bf16 CPU weight hands oneDNN a plain [out, in] matrix, which it re-blocks for its
AVX512-BF16 / AMX micro-kernels on every call. `torch.ops.mkldnn._reorder_linear_weight` does that
once; `torch.ops.mkldnn._linear_pointwise` then runs on the blocked copy (what vLLM's CPU build and
torch.compile's freezing do). Same arithmetic: outputs are bit-identical to F.linear here.

How it stays swappable: a decoder layer packs a group of linears (q/k/v, gate/up, o, down) when it
installs them (`DecoderLayer.set_weights`, also after a load or a restore), so packing is part of the
swap's latency. The group's members are `PackedLinear`s: each implements the linear protocol with
`nbytes()` = its rows of the packed tensor (the members of a group sum to exactly the packed bytes, so
the ledger counts every resident byte) and `.weight` = a plain copy of its rows, read back from the
packed tensor (bit-identical to what was packed) for tools and tests. The plain weights are not kept.

Only where it pays: bf16 on a CPU with native bf16 (engine/capability.py). Elsewhere layers keep
DenseLinear and F.linear.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engine.capability import detect_capability
from engine.precision import Precision, full_precision_for

_PACK_BATCH_HINT = 32  # oneDNN's reorder takes an expected row count; the blocked layout does not depend on it


def packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    dev = torch.device(device)
    return (dev.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and detect_capability(dev).native_bf16)


class PackedGroup:
    """One packed weight computing several linears side by side (outputs concatenated in order)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        """weight: plain [sum of out_features, in] (read, not kept); bias: [sum of out] or None (kept)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.dtype = weight.dtype
        self._blob: Tensor | None = None  # the memory `packed` lives in when made by from_blob

    @classmethod
    def from_blob(cls, blob: Tensor, md: Tensor, bias: Tensor | None, out_features: int, in_features: int,
                  dtype: torch.dtype) -> "PackedGroup":
        """A group over bytes already in oneDNN's packed layout (`to_blob` of an equal group, described
        by `md`): no packing and no copy; the group keeps `blob` alive, since the packed tensor made
        over it does not own it (engine/kernels/mkldnn_blob.cpp)."""
        group = cls.__new__(cls)
        group.packed = torch.ops.morphserve.mkldnn_from_blob(blob, md, [out_features, in_features], dtype)
        group.bias = None if bias is None else bias.detach().contiguous()
        group.out_features, group.in_features, group.dtype = out_features, in_features, dtype
        group._blob = blob
        return group

    def to_blob(self) -> tuple[Tensor, Tensor]:
        """(bytes, descriptor): a copy of the packed bytes and oneDNN's serialized descriptor of them."""
        return torch.ops.morphserve.mkldnn_to_blob(self.packed), torch.ops.mkldnn._get_mkldnn_serialized_md(self.packed)

    def nbytes(self) -> int:
        return int(torch.ops.mkldnn._nbytes(self.packed)) + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def plain_rows(self, start: int, stop: int) -> Tensor:
        """A plain copy of weight rows [start, stop) (bit-identical to what was packed)."""
        return self.packed.to_dense()[start:stop].clone()


class PackedLinear(nn.Module):
    """Rows [row_start, row_start + out_features) of a PackedGroup, as a linear of the protocol."""

    def __init__(self, group: PackedGroup, row_start: int, out_features: int):
        super().__init__()
        self.group, self.row_start = group, row_start
        self.in_features, self.out_features = group.in_features, out_features
        self.precision: Precision = full_precision_for(group.dtype)

    @property
    def weight(self) -> Tensor:
        return self.group.plain_rows(self.row_start, self.row_start + self.out_features)

    @property
    def bias(self) -> Tensor | None:
        b = self.group.bias
        return None if b is None else b[self.row_start:self.row_start + self.out_features]

    def nbytes(self) -> int:
        elem = torch.empty((), dtype=self.group.dtype).element_size()
        bias = 0 if self.group.bias is None else self.out_features * self.group.bias.element_size()
        return self.out_features * self.in_features * elem + bias

    def forward(self, x: Tensor) -> Tensor:
        # Alone (not through the layer's fused call): the group's matmul, then this member's columns.
        y = self.group(x.reshape(-1, self.in_features))[:, self.row_start:self.row_start + self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rows from "
                f"{self.row_start} of a packed group of {self.group.out_features}, precision={self.precision.value}")


def pack_group(weight: Tensor, bias: Tensor | None, out_sizes: Sequence[int]) -> tuple[PackedGroup, list[PackedLinear]]:
    """The packed group of a fused (weight, bias) and one PackedLinear per member, in order."""
    group = PackedGroup(weight, bias)
    members, row = [], 0
    for n in out_sizes:
        members.append(PackedLinear(group, row, n))
        row += n
    if row != group.out_features:
        raise ValueError(f"members cover {row} rows, the fused weight has {group.out_features}")
    return group, members


def packed_group_of(linears: Sequence[nn.Module]) -> PackedGroup | None:
    """The group that `linears` are exactly, in order, else None (e.g. a restore handing back a layer's
    own saved members: nothing to re-pack)."""
    if not linears or not all(isinstance(lin, PackedLinear) for lin in linears):
        return None
    group, row = linears[0].group, 0
    for lin in linears:
        if lin.group is not group or lin.row_start != row:
            return None
        row += lin.out_features
    return group if row == group.out_features else None
