"""INT4 weights: asymmetric, group-wise along the input dimension (AWQ style).

Canonical record (what the host store saves and the checkpoint loaders produce):

    codes[o, i]  in [0, 15]            packed two per byte: qweight[o, j] = codes[o, 2j] | codes[o, 2j+1] << 4
    w[o, i] ~= (codes[o, i] - zeros[o, i // G]) * scales[o, i // G]
    qweight uint8 [out, in/2]   scales fp32 [out, in/G]   zeros uint8 [out, in/G] (integer zero points)

The packed kernels (tinygemm) use another convention: w = (q - 8) * scale + zero_point, with
scales_and_zeros [in/G, out, 2] in bf16. From the canonical form: scale = s, zero_point = (8 - z) * s.
Resident bytes are the same on every backend: in*out/2 (codes) + 4 * out * in/G (bf16 scale and zero).
The packed layouts, their keys and `PackedInt4Weight` (a linear's buffers, storable) are in int4_kernel.py.

As for INT8 (see int8.py), the kernel path computes in bf16 whatever the activations' dtype: on CPU,
2048x2048, one thread, `_weight_int4pack_mm_for_cpu` with fp32 activations took 15 ms (batch 16: 170 ms)
against 0.22 ms (1.6 ms) for cast to bf16 -> kernel -> cast back.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import ModelLoadError
from engine.layers.linear import as_rows, like_input
from engine.precision import Precision
from engine.quant.int4_kernel import (KERNEL_GROUP_SIZES, PackedInt4Weight, amx_eligible, avx2_eligible, int4_mm,
                                      kernel_codes, kernel_layout, layout_backend, pack_int4)
from engine.quant.int4_record import Int4Weight, pack_nibbles, unpack_nibbles
from engine.quant.int8 import KERNEL_DTYPE

__all__ = ["KERNEL_GROUP_SIZES", "Int4Linear", "Int4Weight", "PackedInt4Weight", "fake_quantize_int4",
           "int4_group_size", "pack_int4", "pack_nibbles", "quantize_int4", "unpack_nibbles"]


def int4_group_size(in_features: int, preferred: int = 128) -> int:
    """The group size used for a linear: `preferred`, else halved down to 32 until it divides
    `in_features` (SmolLM2's 576 = 4.5 x 128 gets 64)."""
    g = preferred
    while g >= 32:
        if in_features % g == 0:
            return g
        g //= 2
    raise ModelLoadError(f"INT4 needs in_features divisible by a group size in 32..{preferred}; "
                         f"{in_features} is not (quantize this model to INT8 only)")


def _rtn_groups(w: Tensor, g: int) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 [out, in] -> (codes [out, in/G, G], scales [out, in/G], zeros [out, in/G]), all fp32."""
    w = w.reshape(w.shape[0], -1, g)
    # The range always includes 0, so the integer zero point lands in [0, 15] and a constant
    # group is exact; real weight groups span zero anyway.
    lo = w.amin(dim=-1).clamp_(max=0.0)
    hi = w.amax(dim=-1).clamp_(min=0.0)
    scales = ((hi - lo) / 15).clamp_min_(torch.finfo(torch.float32).tiny)
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    codes = torch.round(w / scales[..., None]).add_(zeros[..., None]).clamp_(0, 15)
    return codes, scales, zeros


def quantize_int4(weight: Tensor, group_size: int = 128) -> Int4Weight:
    """Round-to-nearest asymmetric INT4 of a [out, in] float weight. `group_size` is the preferred
    size; the record holds the one used (see `int4_group_size`)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int4 needs a float [out, in] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    g = int4_group_size(k, group_size)
    codes, scales, zeros = _rtn_groups(weight.detach().float(), g)
    return Int4Weight(qweight=pack_nibbles(codes.reshape(n, k)), scales=scales,
                      zeros=zeros.to(torch.uint8), group_size=g)


def fake_quantize_int4(weight: Tensor, group_size: int = 128) -> Tensor:
    """dequantize(quantize_int4(weight)) in fp32, without packing (AWQ's search calls it many times)."""
    g = int4_group_size(weight.shape[1], group_size)
    codes, scales, zeros = _rtn_groups(weight.detach().float(), g)
    return ((codes - zeros[..., None]) * scales[..., None]).reshape(weight.shape)


class Int4Linear(nn.Module):
    """A linear with INT4 weights. Build it on the device it will run on: the packed layout is
    device-specific, so moving it afterwards is an error."""

    precision = Precision.INT4

    def __init__(self, weight: Int4Weight | PackedInt4Weight, bias: Tensor | None = None):
        """From a canonical record (packed here, on its device) or from already packed buffers (the
        host store's fast path: nothing is copied or packed; the layout must be this device's)."""
        super().__init__()
        packed = weight if isinstance(weight, PackedInt4Weight) else pack_int4(weight)
        packed.check_integrity()
        n, k, g = packed.out_features, packed.in_features, packed.group_size
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        device = packed.packed.device
        expected = kernel_layout(device, n, k, g)
        if packed.layout != expected:
            raise ValueError(f"INT4 weight packed as {packed.layout!r}, but this process packs a [{n}, {k}] weight on "
                             f"{device} as {expected!r}; build it from the canonical Int4Weight instead")
        backend = layout_backend(packed.layout)
        # Plain attributes straight into __dict__: nn.Module.__setattr__ costs ~4 us a call (torch 2.13), and
        # an INT4 swap-down builds 7 of these on the engine thread (~0.2 ms of a 2 ms budget).
        vars(self).update(
            in_features=k, out_features=n, group_size=g,
            layout=packed.layout,  # the key of the packed bytes' layout (int4_kernel.kernel_layout)
            backend=backend,
            amx=backend == "cpu" and amx_eligible(packed.layout, n, k, g),  # AMX op from amx_min_rows rows
            avx2=backend == "cpu" and avx2_eligible(packed.layout, n, k, g))  # fp32 AVX2 op, all rows
        self.register_buffer("packed", packed.packed)
        self.register_buffer("scales_and_zeros", packed.scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.bias) if t is not None)

    def codes(self) -> Tensor:
        if self.backend == "dequant":
            return unpack_nibbles(self.packed)
        return kernel_codes(self.packed, self.in_features, self.out_features, self.group_size)

    def dequantize(self) -> Tensor:
        """The reference path: [out, in] fp32 weights this layer applies, (q - 8) * s + zero_point."""
        g = self.group_size
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [out, in/G, 2]
        s, zp = sz[..., 0].repeat_interleave(g, dim=1), sz[..., 1].repeat_interleave(g, dim=1)
        return (self.codes().float() - 8) * s + zp

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "dequant":
            y = F.linear(x, self.dequantize().to(x.dtype))
        else:
            if self.packed.device.type != self.backend:
                raise RuntimeError(f"Int4Linear was packed for {self.backend} and then moved to {self.packed.device}; "
                                   f"build it from its Int4Weight on the device it runs on")
            sz = self.scales_and_zeros
            if sz.dtype != KERNEL_DTYPE or not sz.is_contiguous():  # someone cast the module, or it is a
                sz = sz.to(KERNEL_DTYPE).contiguous()  # column slice of a fused group (quant/fused.py)
            y = like_input(int4_mm(as_rows(x, self.in_features), self.packed, self.group_size, sz, self.amx,
                                   self.avx2), x, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"backend={self.backend}, bias={self.bias is not None}")
