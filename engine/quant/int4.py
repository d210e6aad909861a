"""INT4 weights: asymmetric, group-wise along the input dimension (AWQ style).

Canonical record (what the host store saves and the checkpoint loaders produce):

    codes[o, i]  in [0, 15]            packed two per byte: qweight[o, j] = codes[o, 2j] | codes[o, 2j+1] << 4
    w[o, i] ~= (codes[o, i] - zeros[o, i // G]) * scales[o, i // G]
    qweight uint8 [out, in/2]   scales fp32 [out, in/G]   zeros uint8 [out, in/G] (integer zero points)

The packed kernels (tinygemm) use another convention: w = (q - 8) * scale + zero_point, with
scales_and_zeros [in/G, out, 2] in bf16. From the canonical form: scale = s, zero_point = (8 - z) * s.
Resident bytes are the same on every backend: in*out/2 (codes) + 4 * out * in/G (bf16 scale and zero).

As for INT8 (see int8.py), the kernel path computes in bf16 whatever the activations' dtype: on CPU,
2048x2048, one thread, `_weight_int4pack_mm_for_cpu` with fp32 activations took 15 ms (batch 16: 170 ms)
against 0.22 ms (1.6 ms) for cast to bf16 -> kernel -> cast back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.errors import ModelLoadError
from engine.precision import Precision
from engine.quant.int8 import KERNEL_DTYPE, kernel_works

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm kernels accept


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


def pack_nibbles(codes: Tensor) -> Tensor:
    """[out, in] integer codes in [0, 15] -> uint8 [out, in/2], even input index in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(qweight: Tensor) -> Tensor:
    """uint8 [out, in/2] -> uint8 codes [out, in]."""
    return torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


@dataclass(frozen=True)
class Int4Weight:
    """The canonical INT4 form of one linear's weight."""

    qweight: Tensor  # uint8 [out, in/2]
    scales: Tensor  # fp32 [out, in/G]
    zeros: Tensor  # uint8 [out, in/G], each in [0, 15]
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * 2

    def check_integrity(self) -> None:
        n, k, g = self.out_features, self.in_features, self.group_size
        if self.qweight.dtype != torch.uint8 or self.qweight.dim() != 2:
            raise ValueError(f"Int4Weight.qweight must be uint8 [out, in/2], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        if g <= 0 or k % g:
            raise ValueError(f"Int4Weight.group_size {g} does not divide in_features {k}")
        for name, t, dtype in (("scales", self.scales, torch.float32), ("zeros", self.zeros, torch.uint8)):
            if t.dtype != dtype or tuple(t.shape) != (n, k // g):
                raise ValueError(f"Int4Weight.{name} must be {dtype} [{n}, {k // g}], got {t.dtype} {tuple(t.shape)}")
        if self.zeros.numel() and int(self.zeros.max()) > 15:
            raise ValueError("Int4Weight.zeros must be in [0, 15]")

    def codes(self) -> Tensor:
        return unpack_nibbles(self.qweight)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[out, in] weights: (codes - zero) * scale, computed in fp32, then cast."""
        g = self.group_size
        z = self.zeros.float().repeat_interleave(g, dim=1)
        s = self.scales.repeat_interleave(g, dim=1)
        return ((self.codes().float() - z) * s).to(dtype)

    def to_tensors(self, prefix: str = "") -> tuple[dict[str, Tensor], dict[str, str]]:
        tensors = {f"{prefix}qweight": self.qweight.contiguous(), f"{prefix}scales": self.scales.contiguous(),
                   f"{prefix}zeros": self.zeros.contiguous()}
        return tensors, {f"{prefix}format": Precision.INT4.value, f"{prefix}group_size": str(self.group_size)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], metadata: dict[str, str], prefix: str = "") -> Int4Weight:
        fmt = metadata.get(f"{prefix}format")
        if fmt != Precision.INT4.value:
            raise ValueError(f"{prefix or 'record'} is stored as {fmt!r}, not int4")
        record = cls(qweight=tensors[f"{prefix}qweight"], scales=tensors[f"{prefix}scales"],
                     zeros=tensors[f"{prefix}zeros"], group_size=int(metadata[f"{prefix}group_size"]))
        record.check_integrity()
        return record


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


def _scales_and_zeros(record: Int4Weight) -> Tensor:
    """Canonical (s, z) -> tinygemm's [in/G, out, 2] (s, (8 - z) * s) in bf16."""
    s = record.scales
    zero_point = (8 - record.zeros.float()) * s
    return torch.stack([s, zero_point], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)


def _pack_for_kernel(codes: Tensor, backend: str) -> Tensor:
    """uint8 codes [out, in] -> the kernel's packed layout (opaque to us; see `Int4Linear.codes`)."""
    if backend == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # CUDA takes bytes with the even input index in the HIGH nibble; innerKTiles as large as K allows.
    k = codes.shape[1]
    inner = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    c = codes.to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack((c[:, 0::2] << 4) | c[:, 1::2], inner)


def _kernel_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor) -> Tensor:
    if packed.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


def _kernel_codes(packed: Tensor, k: int, n: int, group_size: int) -> Tensor:
    """Recover codes [n, k] from any packed layout: with scale 1 and zero point 8 the kernel's weight
    is the code itself, so multiplying identity rows by it reads the codes back exactly."""
    probe_sz = torch.zeros(k // group_size, n, 2, dtype=KERNEL_DTYPE, device=packed.device)
    probe_sz[..., 0], probe_sz[..., 1] = 1.0, 8.0
    eye = torch.eye(k, dtype=KERNEL_DTYPE, device=packed.device)
    rows = [_kernel_mm(eye[i:i + 1024], packed, group_size, probe_sz) for i in range(0, k, 1024)]
    return torch.cat(rows).t().round().to(torch.uint8)  # [k, n] -> [n, k]


def _kernel_backend(device: torch.device, n: int, k: int, g: int) -> str:
    """"cpu" / "cuda" when the packed kernel handles this shape on this device, else "dequant"."""
    if g not in KERNEL_GROUP_SIZES or k % g:
        return "dequant"
    if device.type == "cpu" and n % 16 == 0:
        return "cpu"
    if device.type == "cuda" and n % 8 == 0 and k % 32 == 0:
        def trial() -> bool:  # packs known codes and reads them back: checks op and nibble order
            codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, device=device)
            return bool((_kernel_codes(_pack_for_kernel(codes, "cuda"), 64, 16, 32) == codes).all())
        if kernel_works(f"int4:{device}", trial):
            return "cuda"
    return "dequant"


class Int4Linear(nn.Module):
    """A linear with INT4 weights. Build it on the device it will run on: the packed layout is
    device-specific, so moving it afterwards is an error."""

    precision = Precision.INT4

    def __init__(self, weight: Int4Weight, bias: Tensor | None = None):
        super().__init__()
        weight.check_integrity()
        n, k, g = weight.out_features, weight.in_features, weight.group_size
        self.in_features, self.out_features, self.group_size = k, n, g
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        self.backend = _kernel_backend(weight.qweight.device, n, k, g)
        packed = weight.qweight if self.backend == "dequant" else _pack_for_kernel(weight.codes(), self.backend)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", _scales_and_zeros(weight))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros, self.bias) if t is not None)

    def codes(self) -> Tensor:
        if self.backend == "dequant":
            return unpack_nibbles(self.packed)
        return _kernel_codes(self.packed, self.in_features, self.out_features, self.group_size)

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
            # x: [..., in] -> [tokens, in] in bf16 (the kernels' dtype); y: [tokens, out]
            x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
            sz = self.scales_and_zeros.to(KERNEL_DTYPE)  # no-op unless someone cast the module
            y = _kernel_mm(x2, self.packed, self.group_size, sz)
            y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"backend={self.backend}, bias={self.bias is not None}")
