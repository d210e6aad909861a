"""Precisions a layer's weights can be held in, and the ladder a swap walks down.

torch is imported by the functions that return dtypes, not by this module: the fleet controller
unpickles every report's Precision values, and importing torch there cost its actor ~1 s of CPU at
start, taken from the replicas on a small host (tests/test_controller_imports.py holds it so).
"""
from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Precision(str, enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    INT8 = "int8"  # weight-only, symmetric, per output channel
    INT4 = "int4"  # weight-only, asymmetric, group-wise (AWQ style)

    @property
    def is_full(self) -> bool:
        return self in (Precision.BF16, Precision.FP16, Precision.FP32)

    @property
    def bits(self) -> int:
        return {"bf16": 16, "fp16": 16, "fp32": 32, "int8": 8, "int4": 4}[self.value]


@functools.cache  # built once, on first use (a layer asks for its precision at every load)
def _dtypes() -> dict[Precision, "torch.dtype"]:
    import torch

    return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16, Precision.FP32: torch.float32}


def full_precision_for(dtype: torch.dtype) -> Precision:
    for p, d in _dtypes().items():
        if d == dtype:
            return p
    raise ValueError(f"unsupported dtype {dtype}; use one of bf16, fp16, fp32")


def torch_dtype(p: Precision) -> torch.dtype:
    if not p.is_full:
        raise ValueError(f"{p.value} is not a full-precision dtype")
    return _dtypes()[p]


def parse_dtype(name: str) -> torch.dtype:
    """'bf16' / 'bfloat16' / 'fp16' / 'float16' / 'fp32' / 'float32' -> torch dtype."""
    aliases = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
               "fp32": "fp32", "float32": "fp32", "float": "fp32"}
    key = aliases.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32")
    return _dtypes()[Precision(key)]


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """parse_dtype, plus 'auto': what the device computes natively (engine/capability.py)."""
    if str(name).lower() == "auto":
        from engine.capability import choose_dtype, detect_capability  # reads the device: only when asked
        return choose_dtype(detect_capability(device))
    return parse_dtype(name)


def validate_ladder(ladder: tuple[Precision, ...]) -> tuple[Precision, ...]:
    """A ladder is full -> lower precisions, strictly decreasing in bits, e.g. (BF16, INT8, INT4)."""
    if len(ladder) < 2 or not ladder[0].is_full:
        raise ValueError(f"a morph ladder starts at a full precision and has at least one lower rung, got {ladder}")
    bits = [p.bits for p in ladder]
    if any(b <= a for a, b in zip(bits[1:], bits)) or any(p.is_full for p in ladder[1:]):
        raise ValueError(f"a morph ladder must go strictly down in bits through int8/int4, got {[p.value for p in ladder]}")
    return ladder
