"""INT8 weights: round-to-nearest, symmetric, one scale per output channel.

    w[o, i] ~= qweight[o, i] * scales[o]      qweight in [-127, 127] (int8), scales fp32

Kernel choice (measured on this project's 2-core CPU box, 2048x2048, batch 1, one thread):
`aten._weight_int8pack_mm` is fast only with bf16 activations (0.21 ms vs 0.39 ms bf16 F.linear);
with fp32 activations it takes 6.3 ms (batch 16: 57 ms), and dequantize + F.linear takes 4.9 ms,
while casting the activations to bf16, running the kernel and casting back takes 0.22 ms. So the
kernel path always computes in bf16 and returns the caller's dtype; the dequantize path (no kernel
on this device) computes in the caller's dtype.

From a few rows up torch's kernel is 2-3x slower than the packed bf16 linear (no AMX path), so from
`int8_min_rows` rows (quant/dispatch.py; EngineConfig.int8_amx_min_rows, default 1: always) eligible CPU weights go to the
engine's AMX-INT8 op (engine/kernels/int8_amx.cpp: the same int8 codes and fp32 scales, no relayout; the
activations on a 16-bit grid per row, split exactly into two int8 halves). Both are row-invariant but
round differently, so with a threshold above 1 a request's INT8 outputs can differ with the step's row
count across it; at 1 INT8 layers are exactly batch-invariant.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.precision import Precision
from engine.quant.dispatch import amx_dispatch

KERNEL_DTYPE = torch.bfloat16  # the dtype the packed kernels compute in (see module docstring)
_QMAX = 127  # symmetric range [-127, 127]: -128 is never used so that |w - dq| <= scale / 2


@dataclass(frozen=True)
class Int8Weight:
    """The canonical INT8 form of one linear's weight (what the host store saves)."""

    qweight: Tensor  # int8 [out, in]
    scales: Tensor  # fp32 [out]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    def check_integrity(self) -> None:
        if self.qweight.dtype != torch.int8 or self.qweight.dim() != 2:
            raise ValueError(f"Int8Weight.qweight must be int8 [out, in], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (self.out_features,):
            raise ValueError(f"Int8Weight.scales must be fp32 [{self.out_features}], got {self.scales.dtype} {tuple(self.scales.shape)}")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """[out, in] weights in `dtype` (computed in fp32, then cast)."""
        return (self.qweight.float() * self.scales[:, None]).to(dtype)

    def to_tensors(self, prefix: str = "") -> tuple[dict[str, Tensor], dict[str, str]]:
        """Flat tensors + string metadata, ready for safetensors (`prefix` namespaces both)."""
        tensors = {f"{prefix}qweight": self.qweight.contiguous(), f"{prefix}scales": self.scales.contiguous()}
        return tensors, {f"{prefix}format": Precision.INT8.value}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], metadata: dict[str, str], prefix: str = "") -> Int8Weight:
        fmt = metadata.get(f"{prefix}format")
        if fmt != Precision.INT8.value:
            raise ValueError(f"{prefix or 'record'} is stored as {fmt!r}, not int8")
        record = cls(qweight=tensors[f"{prefix}qweight"], scales=tensors[f"{prefix}scales"])
        record.check_integrity()
        return record


def quantize_int8(weight: Tensor) -> Int8Weight:
    """Round-to-nearest symmetric per-output-channel INT8 of a [out, in] float weight."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_int8 needs a float [out, in] weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().float()
    # An all-zero row gets a tiny positive scale: it quantizes to zeros and dequantizes to zeros.
    scales = (w.abs().amax(dim=1) / _QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    qweight = torch.round(w / scales[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return Int8Weight(qweight=qweight, scales=scales)


_AMX_N, _AMX_K = 16, 64  # the AMX op's tile multiples (output rows, input columns)
def int8_amx_eligible(qweight: Tensor) -> bool:
    """Whether the AMX op can read this [out, in] weight: on CPU, tile-multiple shape, the op built and usable
    here (engine.kernels.int8_amx_reason says why not)."""
    from engine.kernels import int8_amx_op  # lazy: quantizing needs no compiled library
    n, k = qweight.shape
    return qweight.device.type == "cpu" and n % _AMX_N == 0 and k % _AMX_K == 0 and int8_amx_op() is not None


def int8_mm(x: Tensor, qweight: Tensor, scales: Tensor, amx: bool = False) -> Tensor:
    """x [rows, in] bf16 -> [rows, out] bf16 with fp32 per-row `scales`. `amx`: the weight is `int8_amx_eligible`."""
    threshold = amx_dispatch().int8_min_rows
    if amx and threshold is not None and x.shape[0] >= threshold:
        return torch.ops.morphserve.int8_amx_mm(x, qweight, scales)
    return torch.ops.aten._weight_int8pack_mm(x, qweight, scales.to(KERNEL_DTYPE))


_KERNEL_WORKS: dict[str, bool] = {}


def kernel_works(key: str, trial: Callable[[], bool]) -> bool:
    """Run `trial` once per key (e.g. "int8:cuda") and remember whether the kernel is usable there:
    the same aten op may be missing or unsupported on an older GPU, which we learn only by calling it."""
    if key not in _KERNEL_WORKS:
        try:
            _KERNEL_WORKS[key] = bool(trial())
        except (RuntimeError, NotImplementedError):
            _KERNEL_WORKS[key] = False
    return _KERNEL_WORKS[key]


def _int8_kernel_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False

    def trial() -> bool:
        q = torch.ones(16, 32, dtype=torch.int8, device=device)
        y = torch.ops.aten._weight_int8pack_mm(torch.ones(2, 32, dtype=KERNEL_DTYPE, device=device), q,
                                               torch.ones(16, dtype=KERNEL_DTYPE, device=device))
        return bool((y == 32).all())

    return kernel_works(f"int8:{device}", trial)


class Int8Linear(nn.Module):
    """A linear with INT8 weights. Build it on the device it will run on."""

    precision = Precision.INT8

    def __init__(self, weight: Int8Weight, bias: Tensor | None = None):
        super().__init__()
        weight.check_integrity()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.use_kernel = _int8_kernel_available(self.qweight.device)
        self.amx = self.use_kernel and int8_amx_eligible(self.qweight)  # AMX op from int8_amx_min_rows rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.bias) if t is not None)

    def dequantize(self) -> Tensor:
        """The reference path: [out, in] fp32 weights this layer applies."""
        return self.qweight.float() * self.scales[:, None]

    def forward(self, x: Tensor) -> Tensor:
        if self.use_kernel:
            # x: [..., in] -> [tokens, in] in bf16; y: [tokens, out]
            x2 = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
            y = int8_mm(x2, self.qweight, self.scales, self.amx).reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        else:
            y = F.linear(x, (self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None]))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
