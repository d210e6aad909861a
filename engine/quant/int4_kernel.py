"""INT4 in a kernel's packed layout: which layout a device uses, packing into it, reading codes back.

The tinygemm kernels take the weight in an opaque, device-specific layout. Re-packing the canonical
codes (int4.py) into it is most of the cost of building an Int4Linear on CPU (SmolLM2 down_proj,
576x1536: ~6.6 ms of a ~19 ms layer), so the host store also keeps each layer in the CPU layout and
a swap-down only copies bytes. A stored layout is usable only where this process would produce the
very same bytes, so every layout has a key:

    "dequant"                                       canonical nibbles, no kernel (odd shapes)
    "cpu:torch-<version>:<ISA>:inner1:<probe hash>"  _convert_weight_to_int4pack_for_cpu; the ISA
                                                    matters (AVX512 packs 64 columns a block, AVX2 32)
    "cuda:torch-<version>:sm<cc>:inner<t>"          _convert_weight_to_int4pack, innerKTiles t

The probe hash fingerprints the CPU packing itself (a fixed code matrix packed in this process), so
a build whose packing differs gets another key even if version and ISA agree.

Which matmul reads the CPU layout (`kernel_mm(..., amx=True)` for eligible weights, see `amx_eligible`):
torch's `_weight_int4pack_mm_for_cpu` below `int4_min_rows` rows (quant/dispatch.py), the engine's tile op
(`int4_tile_op`, same bytes) from there up: the AMX op (engine/kernels/int4_amx.cpp) on a CPU with AMX,
else the AVX512-BF16 op (engine/kernels/int4_avx512.cpp, vdpbf16ps register tiles; e.g. AMD Zen 4). torch's
kernel has no AMX path, and from a few rows up it is slower than the packed bf16 linear. The AMX op
turns each call's codes into bf16 once (a byte shuffle, no float math per weight) and pads the rows to
a 16-row tile, which costs more than torch's kernel at 1-4 rows, so its default threshold is
AMX_TILE_MIN_ROWS; the AVX512-BF16 op decodes in registers and beats torch's kernel from one row, so
its default threshold is 1 (`resolve_int4_min_rows`, EngineConfig.int4_amx_min_rows='auto'); from 256 rows
(prefill chunks) the AVX512-BF16 op multiplies by the weight dequantized to bf16 block by block through
brgemm, as the bf16 linears do there (INT4 prefill at the bf16 linears' speed instead of 1.13-1.17x). Both are
row-invariant below 256 rows (a row's output does not depend on the other rows), but they round differently from
torch's kernel (last bf16 bit), so with a threshold above 1 a request's INT4 outputs can differ with
the number of rows in the step when it crosses it (as the packed bf16 linear's already do: oneDNN
picks its kernel by row count). A threshold of 1 gives INT4 layers exact batch invariance.
Where torch packs the AVX2 layout (a CPU without AVX-512, hence without native bf16, where the engine
serves fp32), `int4_mm(..., avx2=True)` runs the engine's AVX2 op (engine/kernels/int4_avx2.cpp, same
bytes) in fp32 at every row count: torch's kernel would compute in emulated bf16 (or scalar fp32).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.quant.dispatch import amx_dispatch
from engine.quant.int4_record import Int4Weight
from engine.quant.int8 import KERNEL_DTYPE, kernel_works

KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what the tinygemm kernels accept
DEQUANT_LAYOUT = "dequant"
_AMX_BLOCK_N = 64  # the AVX512 int4pack layout's column block, which the tile ops read
_AVX2_CHUNK_K = 512  # engine/kernels/int4_avx2.cpp: kChunkK, which the group size must divide


@functools.cache
def cpu_layout() -> str:
    """This process's CPU packing key (see the module docstring); computed once, < 1 ms."""
    i = torch.arange(128).unsqueeze(1)
    j = torch.arange(256).unsqueeze(0)
    probe = (i * 7 + j * 13 + (i * j) // 5) % 16  # [n=128, k=256]: two 64-column blocks, every code
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
    digest = hashlib.sha256(packed.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]
    return f"cpu:torch-{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}:inner1:{digest}"


def _cuda_inner_tiles(k: int) -> int:
    return next(t for t in (8, 4, 2) if k % (16 * t) == 0)  # as large as K allows


def _cuda_layout(device: torch.device, k: int) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda:torch-{torch.__version__}:sm{major}{minor}:inner{_cuda_inner_tiles(k)}"


def layout_backend(layout: str) -> str:
    """"cpu" / "cuda" / "dequant": which matmul a layout feeds."""
    return layout.split(":", 1)[0]


def _pack_codes(codes: Tensor, backend: str) -> Tensor:
    """uint8 codes [out, in] -> the kernel's packed layout (opaque to us; see `kernel_codes`)."""
    if backend == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    # CUDA takes bytes with the even input index in the HIGH nibble.
    c = codes.to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack((c[:, 0::2] << 4) | c[:, 1::2], _cuda_inner_tiles(codes.shape[1]))


@functools.cache  # asked for every INT4 linear a swap builds; the answer is fixed for the process
def amx_eligible(layout: str, n: int, k: int, group_size: int) -> bool:
    """Whether the tile op (`int4_tile_op`) can read this weight: this process's AVX512 CPU layout
    (64-column blocks), shapes it handles, and an op built and usable here (engine.kernels.int4_amx_reason /
    int4_avx512_reason say why not)."""
    return (layout == cpu_layout() and layout.split(":")[2] == "AVX512" and n % _AMX_BLOCK_N == 0
            and k % 2 == 0 and group_size % 32 == 0 and int4_tile_op() is not None)  # the AMX op: whole 32-k tiles


@functools.cache  # asked on every eligible call from int4_min_rows rows up; fixed for the process
def int4_tile_op():
    """The engine's INT4 op for the AVX512 int4pack layout: AMX's where the CPU has AMX-BF16, else the
    AVX512-BF16 one; None when neither runs here."""
    from engine.kernels import int4_amx_op, int4_avx512_op  # lazy: loading the library is not needed to pack
    op = int4_amx_op()
    return op if op is not None else int4_avx512_op()


AMX_TILE_MIN_ROWS = 8  # the AMX op's 16-row tiles: below 8 rows torch's kernel is as fast (engine/kernels/int4_amx.cpp)


def resolve_int4_min_rows(setting: int | str | None) -> int | None:
    """EngineConfig.int4_amx_min_rows -> AmxDispatch.int4_min_rows: 'auto' is AMX_TILE_MIN_ROWS for the AMX
    op and 1 for the AVX512-BF16 one, which decodes its codes in registers and takes 0.40-0.45x torch's
    kernel's time even at one row (engine/kernels/int4_avx512.cpp); an int or None is kept."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    from engine.kernels import int4_amx_op  # lazy, as amx_eligible
    return AMX_TILE_MIN_ROWS if int4_amx_op() is not None else 1


@functools.cache  # asked for every INT4 linear a swap builds; the answer is fixed for the process
def avx2_eligible(layout: str, n: int, k: int, group_size: int) -> bool:
    """Whether the AVX2 op (fp32 activations) can read this weight: this process's AVX2 CPU layout
    (32-column blocks), shapes it handles, and the op built here (engine.kernels.int4_avx2_reason)."""
    from engine.kernels import int4_avx2_op  # lazy, as amx_eligible
    return (layout == cpu_layout() and layout.split(":")[2] == "AVX2" and n % 32 == 0 and k % group_size == 0
            and _AVX2_CHUNK_K % group_size == 0 and int4_avx2_op() is not None)


def int4_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor, amx: bool = False,
            avx2: bool = False) -> Tensor:
    """x [rows, in] in any float dtype -> [rows, out] in x's dtype. `avx2`: the weight is `avx2_eligible`,
    and the product is computed in fp32 by the engine's AVX2 op at every row count (the CPUs that use
    this layout have no native bf16, where torch's kernel would emulate it); else `kernel_mm` in bf16."""
    if avx2 and amx_dispatch().int4_avx2:
        return torch.ops.morphserve.int4_avx2_mm(x.float(), packed, group_size, scales_and_zeros).to(x.dtype)
    if x.dtype == KERNEL_DTYPE:  # the serving dtype: two .to() no-ops cost ~3 us a call (4 calls a layer)
        return kernel_mm(x, packed, group_size, scales_and_zeros, amx)
    return kernel_mm(x.to(KERNEL_DTYPE), packed, group_size, scales_and_zeros, amx).to(x.dtype)


def kernel_mm(x: Tensor, packed: Tensor, group_size: int, scales_and_zeros: Tensor, amx: bool = False) -> Tensor:
    """x [rows, in] bf16 -> [rows, out]. `amx`: the weight is `amx_eligible` (the caller knows its layout)."""
    if packed.device.type == "cpu":
        threshold = amx_dispatch().int4_min_rows
        if amx and threshold is not None and x.shape[0] >= threshold:
            return int4_tile_op()(x, packed, group_size, scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


def kernel_codes(packed: Tensor, k: int, n: int, group_size: int) -> Tensor:
    """Recover codes [n, k] from any packed layout: with scale 1 and zero point 8 the kernel's weight
    is the code itself, so multiplying identity rows by it reads the codes back exactly."""
    probe_sz = torch.zeros(k // group_size, n, 2, dtype=KERNEL_DTYPE, device=packed.device)
    probe_sz[..., 0], probe_sz[..., 1] = 1.0, 8.0
    eye = torch.eye(k, dtype=KERNEL_DTYPE, device=packed.device)
    rows = [kernel_mm(eye[i:i + 1024], packed, group_size, probe_sz) for i in range(0, k, 1024)]
    return torch.cat(rows).t().round().to(torch.uint8)  # [k, n] -> [n, k]


def kernel_layout(device: torch.device, n: int, k: int, g: int) -> str:
    """The layout an Int4Linear of this shape uses on `device` (DEQUANT_LAYOUT when no kernel fits)."""
    if g not in KERNEL_GROUP_SIZES or k % g:
        return DEQUANT_LAYOUT
    if device.type == "cpu" and n % 16 == 0:
        return cpu_layout()
    if device.type == "cuda" and n % 8 == 0 and k % 32 == 0:
        def trial() -> bool:  # packs known codes and reads them back: checks op and nibble order
            codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, device=device)
            return bool((kernel_codes(_pack_codes(codes, "cuda"), 64, 16, 32) == codes).all())
        if kernel_works(f"int4:{device}", trial):
            return _cuda_layout(device, k)
    return DEQUANT_LAYOUT


@dataclass(frozen=True)
class PackedInt4Weight:
    """One INT4 linear's weight exactly as Int4Linear holds it: built from these, a linear copies
    nothing and packs nothing. Only valid where `kernel_layout` gives the same `layout`."""

    packed: Tensor  # the layout's bytes: kernel-opaque, or canonical uint8 [out, in/2] for "dequant"
    scales_and_zeros: Tensor  # bf16 [in/G, out, 2]: (s, (8 - z) * s), tinygemm's convention
    group_size: int
    layout: str

    @property
    def out_features(self) -> int:
        return self.scales_and_zeros.shape[1]

    @property
    def in_features(self) -> int:
        return self.scales_and_zeros.shape[0] * self.group_size

    def check_integrity(self) -> None:
        sz, g = self.scales_and_zeros, self.group_size
        if sz.dtype != KERNEL_DTYPE or sz.dim() != 3 or sz.shape[2] != 2 or g <= 0:
            raise ValueError(f"PackedInt4Weight.scales_and_zeros must be {KERNEL_DTYPE} [in/G, out, 2] with "
                             f"group_size > 0, got {sz.dtype} {tuple(sz.shape)}, group_size {g}")
        if self.packed.device != sz.device:
            raise ValueError(f"PackedInt4Weight.packed is on {self.packed.device}, scales_and_zeros on {sz.device}")
        n, k = self.out_features, self.in_features
        if self.packed.numel() * self.packed.element_size() != n * k // 2:
            raise ValueError(f"PackedInt4Weight.packed holds {self.packed.numel() * self.packed.element_size()} "
                             f"bytes, a [{n}, {k}] INT4 weight needs {n * k // 2}")
        if self.layout == DEQUANT_LAYOUT and (self.packed.dtype != torch.uint8 or tuple(self.packed.shape) != (n, k // 2)):
            raise ValueError(f"a {DEQUANT_LAYOUT!r} PackedInt4Weight holds canonical uint8 [{n}, {k // 2}], "
                             f"got {self.packed.dtype} {tuple(self.packed.shape)}")

    def to_tensors(self, prefix: str = "") -> tuple[dict[str, Tensor], dict[str, str]]:
        tensors = {f"{prefix}packed": self.packed.contiguous(), f"{prefix}scales_and_zeros": self.scales_and_zeros.contiguous()}
        return tensors, {f"{prefix}format": "int4-packed", f"{prefix}group_size": str(self.group_size),
                         f"{prefix}layout": self.layout}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], metadata: dict[str, str], prefix: str = "") -> PackedInt4Weight:
        fmt = metadata.get(f"{prefix}format")
        if fmt != "int4-packed":
            raise ValueError(f"{prefix or 'record'} is stored as {fmt!r}, not int4-packed")
        record = cls(packed=tensors[f"{prefix}packed"], scales_and_zeros=tensors[f"{prefix}scales_and_zeros"],
                     group_size=int(metadata[f"{prefix}group_size"]), layout=metadata[f"{prefix}layout"])
        record.check_integrity()
        return record


def _scales_and_zeros(record: Int4Weight) -> Tensor:
    """Canonical (s, z) -> tinygemm's [in/G, out, 2] (s, (8 - z) * s) in bf16."""
    s = record.scales
    zero_point = (8 - record.zeros.float()) * s
    return torch.stack([s, zero_point], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)


def pack_int4(record: Int4Weight) -> PackedInt4Weight:
    """A canonical record -> the layout its device uses (the record's tensors' device)."""
    record.check_integrity()
    n, k, g = record.out_features, record.in_features, record.group_size
    layout = kernel_layout(record.qweight.device, n, k, g)
    backend = layout_backend(layout)
    packed = record.qweight if backend == DEQUANT_LAYOUT else _pack_codes(record.codes(), backend)
    return PackedInt4Weight(packed=packed, scales_and_zeros=_scales_and_zeros(record), group_size=g, layout=layout)

