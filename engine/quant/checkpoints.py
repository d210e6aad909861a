"""Existing INT4 checkpoints as a model's INT4 variant, one layer at a time, into Int4Weight records.

Two layouts (both w = (q - z) * s with unsigned 4-bit q and z):

AutoAWQ GEMM (`quantization_config.quant_method == "awq"`, bits 4, zero_point true):
    qweight int32 [in, out/8]   qzeros int32 [in/G, out/8]   scales fp16 [in/G, out]
    nibble i (bits 4i..4i+3) of packed column c holds output column 8c + AWQ_ORDER[i]

compressed-tensors `pack-quantized` (`quantization_config.format == "pack-quantized"`):
    weight_packed int32 [out, in/8]   nibble i of column c = input 8c + i; stored as q_signed + 8
    weight_scale [out, in/G]
    weight_zero_point int32 [ceil(out/8), in/G] when asymmetric: packed along out, also offset by 8
    symmetric: z = 8 (q_signed = q - 8)
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from torch import Tensor

from engine.errors import ModelLoadError
from engine.model import LINEAR_NAMES, NORM_NAMES, linear_shapes
from engine.model_config import ModelConfig
from engine.precision import Precision
from engine.quant.awq import QuantizedLayer, hf_name
from engine.quant.int4 import Int4Weight, pack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing order of 8 output columns in an int32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass(frozen=True)
class Int4CheckpointFormat:
    method: Literal["awq", "pack-quantized"]
    group_size: int
    symmetric: bool


def int4_checkpoint_format(hf_config: Mapping) -> Int4CheckpointFormat | None:
    """The INT4 layout a config.json declares, None when it declares no quantization."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") == "awq":
        if int(qc.get("bits", qc.get("w_bit", 0))) != 4 or not qc.get("zero_point", True):
            raise ModelLoadError(f"AWQ checkpoint must be 4-bit with zero points, got bits={qc.get('bits')} "
                                 f"zero_point={qc.get('zero_point')}")
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ModelLoadError(f"AWQ checkpoint layout {qc.get('version')!r} is not supported; use the GEMM layout")
        return Int4CheckpointFormat("awq", int(qc.get("group_size", qc.get("q_group_size", 128))), False)
    groups = list((qc.get("config_groups") or {}).values())
    formats = {qc.get("format"), *(g.get("format") for g in groups)}
    if "pack-quantized" in formats:
        weights = [g["weights"] for g in groups if g.get("weights")]
        if len(weights) != 1:
            raise ModelLoadError(f"pack-quantized checkpoint needs exactly one weight scheme, found {len(weights)}")
        w = weights[0]
        if int(w.get("num_bits", 0)) != 4 or w.get("type", "int") != "int" or w.get("strategy") != "group":
            raise ModelLoadError(f"pack-quantized checkpoint must be 4-bit int group-wise, got num_bits={w.get('num_bits')} "
                                 f"type={w.get('type')} strategy={w.get('strategy')}")
        return Int4CheckpointFormat("pack-quantized", int(w["group_size"]), bool(w.get("symmetric", True)))
    raise ModelLoadError(f"unsupported quantization_config (quant_method={qc.get('quant_method')!r}, "
                         f"format={qc.get('format')!r}); MorphServe loads AutoAWQ GEMM and compressed-tensors pack-quantized")


def _get(tensors: Mapping[str, Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> Tensor:
    if name not in tensors:
        raise ModelLoadError(f"INT4 checkpoint lacks tensor {name} (expected shape {list(shape)})")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        raise ModelLoadError(f"INT4 checkpoint tensor {name}: expected shape {list(shape)}, found {list(t.shape)}; "
                             f"the checkpoint does not match this model")
    if dtype is not None and t.dtype != dtype:
        raise ModelLoadError(f"INT4 checkpoint tensor {name}: expected {dtype}, found {t.dtype}")
    return t


def _nibbles(packed: Tensor) -> Tensor:
    """int32 [..., c] -> uint8 [..., c, 8], nibble i at bits 4i..4i+3."""
    return ((packed.unsqueeze(-1) >> _SHIFTS) & 0xF).to(torch.uint8)


def _unpack_awq(packed: Tensor) -> Tensor:
    """AutoAWQ int32 [r, c] -> codes [r, 8c] in natural column order."""
    nib = _nibbles(packed)
    inverse = [AWQ_ORDER.index(j) for j in range(8)]  # column j sits in nibble inverse[j]
    return nib[..., inverse].reshape(packed.shape[0], -1)


def load_awq_linear(tensors: Mapping[str, Tensor], prefix: str, out_f: int, in_f: int, group_size: int) -> Int4Weight:
    """`prefix` is the linear's name without the suffix, e.g. 'model.layers.0.self_attn.q_proj'."""
    if out_f % 8 or in_f % group_size:
        raise ModelLoadError(f"{prefix}: AWQ needs out_features % 8 == 0 and in_features % group_size == 0, "
                             f"got {out_f}, {in_f}, group {group_size}")
    ng = in_f // group_size
    qweight = _get(tensors, f"{prefix}.qweight", (in_f, out_f // 8), torch.int32)
    qzeros = _get(tensors, f"{prefix}.qzeros", (ng, out_f // 8), torch.int32)
    scales = _get(tensors, f"{prefix}.scales", (ng, out_f))
    codes = _unpack_awq(qweight).t()  # [out, in]
    record = Int4Weight(qweight=pack_nibbles(codes), scales=scales.t().float().contiguous(),
                        zeros=_unpack_awq(qzeros).t().contiguous(), group_size=group_size)
    record.check_integrity()
    return record


def load_pack_quantized_linear(tensors: Mapping[str, Tensor], prefix: str, out_f: int, in_f: int,
                               group_size: int, symmetric: bool) -> Int4Weight:
    if in_f % 8 or in_f % group_size:
        raise ModelLoadError(f"{prefix}: pack-quantized needs in_features divisible by 8 and by group_size "
                             f"{group_size}, got {in_f}")
    ng = in_f // group_size
    packed = _get(tensors, f"{prefix}.weight_packed", (out_f, in_f // 8), torch.int32)
    scales = _get(tensors, f"{prefix}.weight_scale", (out_f, ng))
    if f"{prefix}.weight_shape" in tensors and tensors[f"{prefix}.weight_shape"].tolist() != [out_f, in_f]:
        raise ModelLoadError(f"INT4 checkpoint tensor {prefix}.weight_shape: expected {[out_f, in_f]}, "
                             f"found {tensors[f'{prefix}.weight_shape'].tolist()}")
    codes = _nibbles(packed).reshape(out_f, in_f)  # already offset: unsigned code = q_signed + 8
    if symmetric:
        zeros = torch.full((out_f, ng), 8, dtype=torch.uint8)
    else:
        zp = _get(tensors, f"{prefix}.weight_zero_point", ((out_f + 7) // 8, ng), torch.int32)
        # packed along out: nibble i of row r is output row 8r + i
        zeros = _nibbles(zp).permute(0, 2, 1).reshape(-1, ng)[:out_f].contiguous()
    record = Int4Weight(qweight=pack_nibbles(codes), scales=scales.float().contiguous(), zeros=zeros,
                        group_size=group_size)
    record.check_integrity()
    return record


def load_int4_layer(tensors: Mapping[str, Tensor], fmt: Int4CheckpointFormat, config: ModelConfig, layer: int,
                    dtype: torch.dtype = torch.bfloat16) -> QuantizedLayer:
    """Layer `layer` of an INT4 checkpoint (tensors by full HF name) as a QuantizedLayer; its norms and
    biases come from the checkpoint too (AWQ checkpoints carry the norms their scales were folded into)."""
    base = f"model.layers.{layer}."
    linears = {}
    for name, (out_f, in_f) in linear_shapes(config).items():
        prefix = base + hf_name(name).removesuffix(".weight")
        if fmt.method == "awq":
            linears[name] = load_awq_linear(tensors, prefix, out_f, in_f, fmt.group_size)
        else:
            linears[name] = load_pack_quantized_linear(tensors, prefix, out_f, in_f, fmt.group_size, fmt.symmetric)
    norms = {n: _get(tensors, f"{base}{n}.weight", (config.hidden_size,)).to(dtype) for n in NORM_NAMES}
    biases = {n: _get(tensors, base + hf_name(n, "bias"), (linears[n].out_features,)).to(dtype)
              for n in LINEAR_NAMES if base + hf_name(n, "bias") in tensors}
    out = QuantizedLayer(Precision.INT4, linears, norms, biases)
    out.check_integrity()
    return out


class _LazyTensors(Mapping):
    """Tensors of every *.safetensors file in a folder, read on access (memory-mapped by safetensors)."""

    def __init__(self, folder: Path):
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in sorted(folder.glob("*.safetensors"))]
        self._where = {name: h for h in self._handles for name in h.keys()}

    def __getitem__(self, name: str) -> Tensor:
        return self._where[name].get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def open_int4_checkpoint(folder: Path) -> tuple[Int4CheckpointFormat, Mapping[str, Tensor]]:
    """A checkpoint folder (config.json + safetensors) -> its INT4 layout and lazy tensors by name."""
    folder = Path(folder)
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'} ({e}); pass an INT4 checkpoint folder") from e
    fmt = int4_checkpoint_format(hf_config)
    if fmt is None:
        raise ModelLoadError(f"{folder} has no quantization_config in config.json; it is not an INT4 checkpoint")
    tensors = _LazyTensors(folder)
    if not tensors:
        raise ModelLoadError(f"{folder} has no .safetensors files")
    return fmt, tensors
