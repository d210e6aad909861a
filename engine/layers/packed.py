"""Full-precision linears with pre-packed weights, still swappable.

F.linear on a bf16 CPU weight hands oneDNN a plain [out, in] matrix, which it re-blocks for its
AVX512-BF16 / AMX micro-kernels on every call; on an fp32 weight it calls MKL's sgemm, which on an
AVX2-only AMD EPYC ran SmolLM2's 30 layers at 1.75-2.7x the time of oneDNN's packed fp32 kernel at
4-32 rows, and its 49,152-row head at 1.9-2.4x (2 threads, distinct weights per layer, 2026-12-02).
Packing once, when a layer is installed, avoids both.
Two layouts, chosen per group by what this process can run (`PackedGroup.layout`):

- "vnni32" (a CPU with AVX512-BF16 and the engine's compiled kernels): the weight as
  [out/32, in/2, 32, 2], AMX's B operand in 32-column blocks, which is also what vdpbf16ps takes. Needs
  in and out features that are multiples of 32. Two ops run it (`vnni_op`):
  - with AMX-BF16 (engine/kernels/bf16_amx.cpp): up to 32 rows (decode steps) the op streams each block
    once, in order, with prefetch: oneDNN's blocked kernel read 30 layers' weights at 6-8 GB/s at 32
    rows on a 2-core Xeon, a plain read of the same bytes runs at 14 GB/s. More rows go through ATen's
    brgemm on the same bytes; from `PLAIN_GEMM_ROWS` rows (large offline prefill chunks) the group is
    unpacked into a transient plain copy for F.linear (oneDNN's own GEMM), which at 4,096 rows took
    0.67x the brgemm route's time including the unpack;
  - with AVX512-BF16 and no AMX (engine/kernels/bf16_avx512.cpp, e.g. AMD Zen 4): register tiles of
    vdpbf16ps up to 255 rows, brgemm from 256; 0.53-0.85x oneDNN's time at 1-32 rows, 0.95-0.98x at
    256-4,096 on a 2-core EPYC.
- "mkldnn" (elsewhere): `torch.ops.mkldnn._reorder_linear_weight` once, `_linear_pointwise` per call
  (what vLLM's CPU build and torch.compile's freezing do); in bf16 outputs bit-identical to F.linear
  (which is oneDNN too), in fp32 within float rounding of it (MKL sums in another order).

How it stays swappable: a decoder layer packs a group of linears (q/k/v, gate/up, o, down) when it
installs them (`DecoderLayer.set_weights`, also after a load or a restore), so packing is part of the
swap's latency (a restore from the packed store maps bytes already laid out: engine/morph/packed_store.py).
The group's members are `PackedLinear`s: each implements the linear protocol with `nbytes()` = its rows
of the packed tensor (the members of a group sum to exactly the packed bytes, so the ledger counts every
resident byte) and `.weight` = a plain copy of its rows, read back from the packed tensor (bit-identical
to what was packed) for tools and tests. The plain weights are not kept.

Where it pays: bf16 on a CPU with native bf16 (engine/capability.py), and fp32 on any CPU with oneDNN
(dtype=auto's choice where bf16 is not native). Elsewhere (CUDA, fp16, emulated bf16) layers keep
DenseLinear and F.linear.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.capability import detect_capability
from engine.kernels import bf16_amx_op, bf16_avx512_op
from engine.precision import Precision, full_precision_for

_PACK_BATCH_HINT = 32  # oneDNN's reorder takes an expected row count; the blocked layout does not depend on it
VNNI_BLOCK = 32  # columns per block of the "vnni32" layout (engine/kernels/bf16_amx.cpp, bf16_avx512.cpp)
_VNNI_MD = b"morphserve:vnni32"  # the descriptor to_blob returns for that layout (oneDNN's is its serialized md)
# From this many rows a vnni32 call on AMX unpacks the weight and runs F.linear. Measured on a 2-core Xeon
# (SmolLM2's four weight shapes, 2 threads): brgemm route / (unpack + F.linear) = 0.83 at 1,024 rows,
# 1.3 at 2,048, 1.5 at 4,096. The transient copy (one group's weight, out x in bf16) is smaller than the
# activation reserve a step of this many rows implies (rows x (hidden + intermediate + vocab) x 2 B,
# engine/memory_plan.py) for Llama-shaped models.
PLAIN_GEMM_ROWS = 2048


def vnni_layout_fits(weight: Tensor) -> bool:
    """The "vnni32" layout can hold `weight` ([out, in]) and this process can run it."""
    out_f, in_f = weight.shape
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and out_f % VNNI_BLOCK == 0
            and in_f % VNNI_BLOCK == 0 and vnni_op() is not None)


@functools.cache  # fixed for the process; asked on every vnni32 call
def _vnni_route() -> tuple[object | None, int | None]:
    """(the op that runs vnni32 groups here, rows from which a call unpacks and runs F.linear instead):
    AMX's op with `PLAIN_GEMM_ROWS` where the CPU has AMX-BF16, else the AVX512-BF16 one, which stays
    the faster route at any row count (brgemm from 256 rows); (None, None) when neither can run."""
    amx = bf16_amx_op()
    return (amx, PLAIN_GEMM_ROWS) if amx is not None else (bf16_avx512_op(), None)


def vnni_op():
    """The op that runs vnni32 groups here, or None (then groups take oneDNN's layout)."""
    return _vnni_route()[0]


def pack_vnni(weight: Tensor) -> Tensor:
    """[out, in] -> [out/32, in/2, 32, 2]: block b, pair-row p holds (w[32 b + j, 2 p], w[32 b + j, 2 p + 1])."""
    out_f, in_f = weight.shape
    return weight.detach().reshape(out_f // VNNI_BLOCK, VNNI_BLOCK, in_f // 2, 2).transpose(1, 2).contiguous()


def unpack_vnni(packed: Tensor) -> Tensor:
    """The plain [out, in] copy. Each (k even, k odd) pair moves as one int32: 3x faster than moving
    bf16 elements two at a time."""
    blocks, pairs = packed.shape[:2]
    as_pairs = packed.view(torch.int32).view(blocks, pairs, VNNI_BLOCK)
    return as_pairs.transpose(1, 2).contiguous().view(torch.bfloat16).view(blocks * VNNI_BLOCK, pairs * 2)


def vnni_rows(packed: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` ([T] long) of the plain weight, read from its vnni32 layout: what F.embedding(ids, plain)
    returns, for a tied embedding kept only packed (`Transformer.pack_linears`). Row r is column r % 32 of
    block r // 32, one (k even, k odd) int32 pair per pair-row: gathering int32s took half the time of
    gathering bf16 pairs (1.3 ms for 1,024 tokens of SmolLM2 at 2 threads, beside a prefill's ~1 s)."""
    blocks, pairs = packed.shape[:2]
    as_pairs = packed.view(torch.int32).view(blocks, pairs, VNNI_BLOCK)
    return as_pairs[ids // VNNI_BLOCK, :, ids % VNNI_BLOCK].view(torch.bfloat16)  # [T, pairs] int32 -> [T, in]


def packing_available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether full-precision linears of `dtype` on `device` are packed (see the module docstring)."""
    dev = torch.device(device)
    if dev.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and detect_capability(dev).native_bf16)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN's linear on a plain [out, in] weight, reordered per call (no packed copy kept): for an fp32
    weight too large to keep twice (a tied head), where F.linear would run MKL's sgemm."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class PackedGroup:
    """One packed weight computing several linears side by side (outputs concatenated in order)."""

    def __init__(self, weight: Tensor, bias: Tensor | None):
        """weight: plain [sum of out_features, in] (read, not kept); bias: [sum of out] or None (kept)."""
        if vnni_layout_fits(weight):
            self.layout, self.packed = "vnni32", pack_vnni(weight)
        else:
            self.layout, self.packed = "mkldnn", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.dtype = weight.dtype
        self._blob: Tensor | None = None  # the memory `packed` lives in when made by from_blob

    @classmethod
    def from_blob(cls, blob: Tensor, md: Tensor, bias: Tensor | None, out_features: int, in_features: int,
                  dtype: torch.dtype) -> "PackedGroup":
        """A group over bytes already in a packed layout (`to_blob` of an equal group, described by `md`):
        no packing and no copy; the group keeps `blob` alive (an mkldnn tensor made over it does not own
        it, engine/kernels/mkldnn_blob.cpp)."""
        group = cls.__new__(cls)
        if bytes(md.numpy()) == _VNNI_MD:
            group.layout = "vnni32"
            group.packed = blob.view(dtype).view(out_features // VNNI_BLOCK, in_features // 2, VNNI_BLOCK, 2)
        else:
            group.layout = "mkldnn"
            group.packed = torch.ops.morphserve.mkldnn_from_blob(blob, md, [out_features, in_features], dtype)
        group.bias = None if bias is None else bias.detach().contiguous()
        group.out_features, group.in_features, group.dtype = out_features, in_features, dtype
        group._blob = blob
        return group

    def to_blob(self) -> tuple[Tensor, Tensor]:
        """(bytes, descriptor): a copy of the packed bytes and what says how they are laid out."""
        if self.layout == "vnni32":
            return self.packed.reshape(-1).view(torch.uint8).clone(), torch.frombuffer(bytearray(_VNNI_MD), dtype=torch.uint8)
        return torch.ops.morphserve.mkldnn_to_blob(self.packed), torch.ops.mkldnn._get_mkldnn_serialized_md(self.packed)

    def nbytes(self) -> int:
        packed = self.packed.nbytes if self.layout == "vnni32" else int(torch.ops.mkldnn._nbytes(self.packed))
        return packed + (0 if self.bias is None else self.bias.nbytes)

    def __call__(self, x: Tensor) -> Tensor:
        if self.layout == "vnni32":
            op, unpack_from = _vnni_route()
            if unpack_from is not None and x.dim() == 2 and x.shape[0] >= unpack_from:
                return F.linear(x, unpack_vnni(self.packed), self.bias)
            return op(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def plain_rows(self, start: int, stop: int) -> Tensor:
        """A plain copy of weight rows [start, stop) (bit-identical to what was packed)."""
        plain = unpack_vnni(self.packed) if self.layout == "vnni32" else self.packed.to_dense()
        return plain[start:stop].clone()


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
