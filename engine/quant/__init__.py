"""Weight formats below full precision: INT8 (per channel) and INT4 (group-wise), their linears,
the project's AWQ, and loaders for existing INT4 checkpoints (`engine.quant.awq`, `.checkpoints`)."""
from __future__ import annotations

import torch
from torch import Tensor

from engine.precision import Precision, torch_dtype
from engine.quant.int4 import Int4Linear, Int4Weight, int4_group_size, quantize_int4
from engine.quant.int4_kernel import PackedInt4Weight, pack_int4
from engine.quant.int8 import KERNEL_DTYPE, Int8Linear, Int8Weight, quantize_int8

QuantizedWeight = Int8Weight | Int4Weight | PackedInt4Weight  # PackedInt4Weight: INT4 as a device's kernel holds it

__all__ = ["Int8Weight", "Int8Linear", "quantize_int8", "Int4Weight", "Int4Linear", "quantize_int4",
           "int4_group_size", "PackedInt4Weight", "pack_int4", "QuantizedWeight", "quantized_nbytes", "to_tensors",
           "from_tensors", "make_linear"]


def quantized_nbytes(precision: Precision, out_features: int, in_features: int, group_size: int = 128,
                     *, bias_dtype: torch.dtype | None = None) -> int:
    """Resident bytes of one linear held in `precision` (what `nbytes()` of its linear returns), known
    before anything is quantized. `group_size` is the preferred INT4 group size, as in quantize_int4.
    Full precisions count a dense weight of that dtype. `bias_dtype` adds a bias of out_features."""
    n, k = out_features, in_features
    bias = 0 if bias_dtype is None else n * torch.empty((), dtype=bias_dtype).element_size()
    if precision.is_full:
        return n * k * torch.empty((), dtype=torch_dtype(precision)).element_size() + bias
    if precision == Precision.INT8:
        return n * k + n * 4 + bias  # int8 codes + fp32 scale per row
    if precision == Precision.INT4:
        g = int4_group_size(k, group_size)
        sz_itemsize = torch.empty((), dtype=KERNEL_DTYPE).element_size()
        return n * k // 2 + (k // g) * n * 2 * sz_itemsize + bias  # packed codes + (scale, zero point)
    raise ValueError(f"no quantized size for {precision}")


def to_tensors(record: QuantizedWeight, prefix: str = "") -> tuple[dict[str, Tensor], dict[str, str]]:
    """A record as flat tensors + string metadata for safetensors; keys start with `prefix`."""
    return record.to_tensors(prefix)


def from_tensors(tensors: dict[str, Tensor], metadata: dict[str, str], prefix: str = "") -> QuantizedWeight:
    """Inverse of `to_tensors`; the metadata says which format the record is."""
    fmt = metadata.get(f"{prefix}format")
    if fmt == Precision.INT8.value:
        return Int8Weight.from_tensors(tensors, metadata, prefix)
    if fmt == Precision.INT4.value:
        return Int4Weight.from_tensors(tensors, metadata, prefix)
    if fmt == "int4-packed":
        return PackedInt4Weight.from_tensors(tensors, metadata, prefix)
    raise ValueError(f"no quantized record under prefix {prefix!r} (format metadata is {fmt!r})")


def make_linear(record: QuantizedWeight, bias: Tensor | None = None) -> Int8Linear | Int4Linear:
    """The linear for a record, on the record's device."""
    return Int8Linear(record, bias) if isinstance(record, Int8Weight) else Int4Linear(record, bias)
