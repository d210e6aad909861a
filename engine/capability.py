"""What the device computes natively, and the full-precision dtype `dtype="auto"` picks from it.

    choose_dtype(capability)      pure: bf16 where the device has native bf16 arithmetic (CPU:
                                  AVX512-BF16 or AMX-BF16; CUDA: sm80+), fp16 on older GPUs, fp32 on
                                  other CPUs (there bf16 is emulated: on an AVX2-only EPYC one
                                  32x576x1536 linear ran at 10 GFLOPS in bf16 against 57 in fp32)
    detect_capability(device)     reads torch's CPU capability, /proc/cpuinfo flags, the CUDA compute
                                  capability (cached per device type)

Tests inject a `DeviceCapability` into `choose_dtype`; nothing here is read from a global at import.
torch is imported by the functions that need it: a DeviceCapability travels in every MorphState a
replica reports, and the fleet controller that unpickles it has no use for torch (engine/precision.py).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

# The /proc/cpuinfo flags that decide dtype and kernels (others are noise in a status record).
CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512vbmi", "avx512_bf16", "avx512_fp16",
                         "amx_tile", "amx_bf16", "amx_int8")
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_MIN_CUDA_SM = (8, 0)


@dataclasses.dataclass(frozen=True)
class DeviceCapability:
    device: Literal["cpu", "cuda"]
    cpu_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX512", "AVX2", "DEFAULT", ...
    cpu_flags: tuple[str, ...]  # the CPU_FLAGS_OF_INTEREST this CPU has
    cuda_sm: tuple[int, int] | None = None  # compute capability of the CUDA device, None on CPU

    @property
    def native_bf16(self) -> bool:
        if self.device == "cuda":
            return self.cuda_sm is not None and self.cuda_sm >= BF16_MIN_CUDA_SM
        return any(f in self.cpu_flags for f in NATIVE_BF16_CPU_FLAGS)

    def as_dict(self) -> dict:
        """For status records and benchmark JSON."""
        return {"device": self.device, "cpu_capability": self.cpu_capability, "cpu_flags": list(self.cpu_flags),
                "cuda_sm": None if self.cuda_sm is None else f"{self.cuda_sm[0]}.{self.cuda_sm[1]}",
                "native_bf16": self.native_bf16, "auto_dtype": str(choose_dtype(self)).removeprefix("torch.")}

    def describe(self) -> str:
        sm = f", sm{self.cuda_sm[0]}{self.cuda_sm[1]}" if self.cuda_sm else ""
        return (f"{self.device}{sm}: cpu capability {self.cpu_capability}, flags {','.join(self.cpu_flags) or '-'}, "
                f"native bf16 {'yes' if self.native_bf16 else 'no'} -> dtype=auto is "
                f"{str(choose_dtype(self)).removeprefix('torch.')}")


def choose_dtype(cap: DeviceCapability) -> torch.dtype:
    import torch

    if cap.native_bf16:
        return torch.bfloat16
    return torch.float16 if cap.device == "cuda" else torch.float32


def parse_cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    """The flags of interest from /proc/cpuinfo text (first 'flags' line)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            present = set(line.partition(":")[2].split())
            return tuple(f for f in CPU_FLAGS_OF_INTEREST if f in present)
    return ()


@functools.cache
def _cpu_facts() -> tuple[str, tuple[str, ...]]:
    import torch

    try:
        flags = parse_cpu_flags(Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace"))
    except OSError:  # not Linux: torch's capability string is all we know
        flags = ()
    return torch.backends.cpu.get_cpu_capability(), flags


def detect_capability(device: str | torch.device = "cpu") -> DeviceCapability:
    import torch

    dev = torch.device(device)
    cpu_cap, flags = _cpu_facts()
    if dev.type == "cuda":
        return DeviceCapability("cuda", cpu_cap, flags, tuple(torch.cuda.get_device_capability(dev)))
    return DeviceCapability("cpu", cpu_cap, flags)
