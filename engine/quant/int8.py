"""INT8 weights: round-to-nearest, symmetric, one scale per output channel.

    w[o, i] ~= qweight[o, i] * scales[o]      qweight in [-127, 127] (int8), scales fp32

Kernel choice (measured on this project's 2-core CPU box, 2048x2048, batch 1, one thread):
`aten._weight_int8pack_mm` is fast only with bf16 activations (0.21 ms vs 0.39 ms bf16 F.linear);
with fp32 activations it takes 6.3 ms (batch 16: 57 ms), and dequantize + F.linear takes 4.9 ms,
while casting the activations to bf16, running the kernel and casting back takes 0.22 ms. So the
kernel path always computes in bf16 and returns the caller's dtype; the dequantize path (no kernel
on this device) computes in the caller's dtype.

From a few rows up torch's kernel is 2-3x slower than the packed bf16 linear (no AMX path), so from
`int8_min_rows` rows (quant/dispatch.py; EngineConfig.int8_amx_min_rows, default 'auto':
`resolve_int8_min_rows`) eligible CPU weights go to the engine's tile op (`int8_tile_op`; the same int8
codes and fp32 scales, no relayout): AMX-INT8's (engine/kernels/int8_amx.cpp: the activations on a 16-bit
grid per row, split exactly into two int8 halves), else, on a CPU with AVX512-BF16 (e.g. AMD Zen 4, where
torch's kernel took 1.6-3.4x the bf16 linears' time at 1-512 rows), the AVX512 one
(engine/kernels/int8_avx512.cpp: each block of 32 weight rows converted to bf16 exactly, then the bf16
linear's register tiles, brgemm from 256 rows; 1.34-1.52x at 1-16 rows, 1.20x at 64, 1.01-1.05x from 256).
The tile ops are row-invariant (the AVX512 one below 256 rows, as the bf16 linear) but round differently
from torch's kernel, so with a threshold above 1 a request's INT8 outputs can differ with the step's row
count across it; at 1 INT8 layers are exactly batch-invariant (on the AVX512 op, in steps below 256
rows). 'auto' takes 1 for the AMX op and 12 for the AVX512 one, which converts every call's codes into a
buffer first; below its threshold the AVX512 CPU runs the few-rows op (`int8_rows_op`: codes converted in
registers, 0.63-0.79x the bf16 linears at 1-4 rows), not torch's kernel.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.layers.linear import as_rows, like_input
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
_AVX512_N, _AVX512_K = 32, 32  # the AVX512 op's: its 32-row blocks, 32 k per conversion


@functools.cache  # asked on every eligible call; fixed for the process
def int8_tile_op():
    """The engine's INT8 op for the plain [out, in] int8 record: AMX-INT8's (engine/kernels/int8_amx.cpp) where
    the CPU has it, else the AVX512-BF16 one (engine/kernels/int8_avx512.cpp: the codes converted to bf16 block
    by block, then the bf16 linear's register tiles, or brgemm from 256 rows); None when neither runs here."""
    from engine.kernels import int8_amx_op, int8_avx512_op  # lazy: quantizing needs no compiled library
    op = int8_amx_op()
    return op if op is not None else int8_avx512_op()


def int8_amx_eligible(qweight: Tensor) -> bool:
    """Whether the tile op (`int8_tile_op`) can read this [out, in] weight: on CPU, a shape it takes, and an op
    built and usable here (engine.kernels.int8_amx_reason / int8_avx512_reason say why not)."""
    from engine.kernels import int8_amx_op  # lazy, as int8_tile_op
    n, k = qweight.shape
    if qweight.device.type != "cpu" or int8_tile_op() is None:
        return False
    if int8_amx_op() is not None:
        return n % _AMX_N == 0 and k % _AMX_K == 0
    return n % _AVX512_N == 0 and k % _AVX512_K == 0


AVX512_TILE_MIN_ROWS = 12  # the AVX512 tile op fills a buffer per call: below a 12-row tile, the few-rows op


def resolve_int8_min_rows(setting: int | str | None) -> int | None:
    """EngineConfig.int8_amx_min_rows -> AmxDispatch.int8_min_rows: 'auto' is 1 for the AMX op and
    AVX512_TILE_MIN_ROWS for the AVX512-BF16 one, below which its few-rows op runs (`int8_rows_op`; Zen 4, four
    shapes summed: the few-rows op 0.63 / 0.79 / 1.23 / 1.83x the bf16 linears at 1 / 4 / 8 / 16 rows, the
    tile op 1.34 / 1.35 / 1.41 / 1.52x); an int or None is kept."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    from engine.kernels import int8_amx_op  # lazy, as int8_tile_op
    return 1 if int8_amx_op() is not None else AVX512_TILE_MIN_ROWS


@functools.cache  # asked on every eligible call below the threshold; fixed for the process
def int8_rows_op():
    """The op for eligible INT8 weights below the tile op's threshold: on a CPU whose tile op is the AVX512
    one, its few-rows op (engine/kernels/int8_avx512.cpp: int8_avx512_rows_mm, codes converted in registers,
    no buffer; Zen 4, four shapes summed: 0.63x / 0.70x / 0.79x the bf16 linears at 1 / 2 / 4 rows where
    torch's kernel took 1.59x / 1.72x / 1.92x); None (torch's kernel) elsewhere."""
    from engine.kernels import int8_amx_op, int8_avx512_rows_op  # lazy, as int8_tile_op
    return None if int8_amx_op() is not None else int8_avx512_rows_op()


def int8_mm(x: Tensor, qweight: Tensor, scales: Tensor, amx: bool = False) -> Tensor:
    """x [rows, in] in any float dtype -> [rows, out] in x's dtype, computed in bf16, with fp32 per-row `scales`.
    `amx`: the weight is `int8_amx_eligible`: the tile op (AMX's or AVX512-BF16's) from int8_min_rows rows, the
    few-rows op below (`int8_rows_op`, where there is one); torch's kernel otherwise, and at every row count
    when the threshold is None."""
    if x.dtype != KERNEL_DTYPE:  # the serving dtype skips both casts (~3 us a call, as int4_mm)
        return int8_mm(x.to(KERNEL_DTYPE), qweight, scales, amx).to(x.dtype)
    threshold = amx_dispatch().int8_min_rows
    if amx and threshold is not None:
        if x.shape[0] >= threshold:
            return int8_tile_op()(x, qweight, scales)
        if (rows_op := int8_rows_op()) is not None:
            return rows_op(x, qweight, scales)
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
            y = like_input(int8_mm(as_rows(x, self.in_features), self.qweight, self.scales, self.amx), x,
                           self.out_features)
        else:
            y = F.linear(x, (self.qweight.to(x.dtype) * self.scales.to(x.dtype)[:, None]))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
