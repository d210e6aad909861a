"""The project's own AWQ (activation-aware weight quantization) for one decoder layer, and plain RTN.

Why it works: a linear's output error from quantizing W is dominated by the input channels with
large activations. Scaling those weight columns up by s (and the inputs down by 1/s) gives them more
of the INT4 grid; the function is unchanged in full precision because 1/s is folded into the op that
produces the input, inside the same layer:

    group         inputs                          s folded (divided) into
    q, k, v       input_layernorm(x)              input_layernorm weight
    o             attention output                v_proj rows (+ bias); heads sharing a kv head share s
    gate, up      post_attention_layernorm(h)     post_attention_layernorm weight
    down          silu(gate) * up                 up_proj rows (+ bias)

Per group, s = mean(|input|)^alpha (normalised), alpha on a grid in [0, 1]; alpha = 0 is plain RTN,
so the chosen s never does worse than RTN on the calibration tokens. Runs at prepare time on CPU.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.errors import ModelLoadError
from engine.model import ATTENTION_LINEARS, LINEAR_NAMES, NORM_NAMES
from engine.model_config import ModelConfig
from engine.precision import Precision
from engine.quant import make_linear
from engine.quant.int4 import Int4Linear, Int4Weight, fake_quantize_int4, quantize_int4
from engine.quant.int4_kernel import PackedInt4Weight
from engine.quant.int8 import Int8Linear, Int8Weight, quantize_int8



def hf_name(linear: str, kind: str = "weight") -> str:
    """'q_proj' -> 'self_attn.q_proj.weight' (an HF name without the 'model.layers.{i}.' prefix)."""
    return f"{'self_attn' if linear in ATTENTION_LINEARS else 'mlp'}.{linear}.{kind}"


@dataclass(frozen=True)
class LayerWeights:
    """A decoder layer's full-precision tensors, keyed by short names ('q_proj', 'input_layernorm')."""

    linears: Mapping[str, Tensor]  # [out, in]
    norms: Mapping[str, Tensor]  # [hidden]
    biases: Mapping[str, Tensor]  # only the linears that have one

    @classmethod
    def of_layer(cls, layer: torch.nn.Module, device: torch.device | str | None = None) -> LayerWeights:
        """A decoder layer's tensors as it holds them (no copies unless moved to `device`). It must be
        at full precision: quantized linears have no dense weight to give."""
        linears = layer.get_linears()
        if not all(lin.precision.is_full for lin in linears.values()):
            raise ValueError("the layer is not at full precision; take its weights before any swap")
        move = (lambda t: t) if device is None else (lambda t: t.to(device))
        return cls(linears={n: move(lin.weight) for n, lin in linears.items()},
                   norms={n: move(t) for n, t in layer.get_norm_weights().items()},
                   biases={n: move(lin.bias) for n, lin in linears.items() if lin.bias is not None})

    @classmethod
    def from_hf(cls, tensors: Mapping[str, Tensor]) -> LayerWeights:
        """From HF names without the layer prefix ('self_attn.q_proj.weight', 'input_layernorm.weight')."""
        missing = [hf_name(n) for n in LINEAR_NAMES if hf_name(n) not in tensors]
        missing += [f"{n}.weight" for n in NORM_NAMES if f"{n}.weight" not in tensors]
        if missing:
            raise ModelLoadError(f"layer weights lack {missing}; pass names without the 'model.layers.N.' prefix")
        return cls(linears={n: tensors[hf_name(n)] for n in LINEAR_NAMES},
                   norms={n: tensors[f"{n}.weight"] for n in NORM_NAMES},
                   biases={n: tensors[hf_name(n, "bias")] for n in LINEAR_NAMES if hf_name(n, "bias") in tensors})


@dataclass(frozen=True)
class QuantizedLayer:
    """One layer at a lower precision: 7 quantized linears + the norm weights and biases to use with
    them (AWQ changes input/post_attention_layernorm, v_proj's and up_proj's biases)."""

    precision: Precision
    linears: Mapping[str, Int8Weight | Int4Weight | PackedInt4Weight]
    norms: Mapping[str, Tensor]
    biases: Mapping[str, Tensor]

    def check_integrity(self) -> None:
        if set(self.linears) != set(LINEAR_NAMES) or set(self.norms) != set(NORM_NAMES):
            raise ValueError(f"a quantized layer needs linears {LINEAR_NAMES} and norms {NORM_NAMES}, "
                             f"got {sorted(self.linears)} and {sorted(self.norms)}")
        # INT4 may come from the host store already in this device's kernel layout (PackedInt4Weight).
        record_types = (Int8Weight,) if self.precision == Precision.INT8 else (Int4Weight, PackedInt4Weight)
        for name, record in self.linears.items():
            if not isinstance(record, record_types):
                raise ValueError(f"{name} is {type(record).__name__}, expected "
                                 f"{' or '.join(t.__name__ for t in record_types)} for {self.precision.value}")
            record.check_integrity()
            bias = self.biases.get(name)
            if bias is not None and tuple(bias.shape) != (record.out_features,):
                raise ValueError(f"{name} bias is {tuple(bias.shape)}, expected ({record.out_features},)")

    def build_linears(self, device: torch.device | str = "cpu") -> dict[str, Int8Linear | Int4Linear]:
        """The 7 linears on `device` (packed there), ready for DecoderLayer.set_weights with `norms`."""
        moved = {n: r if _on(r, device) else dataclasses.replace(
                     r, **{f.name: getattr(r, f.name).to(device) for f in dataclasses.fields(r)
                           if isinstance(getattr(r, f.name), Tensor)})
                 for n, r in self.linears.items()}
        return {n: make_linear(r, None if n not in self.biases else self.biases[n].to(device))
                for n, r in moved.items()}


def _on(record, device: torch.device | str) -> bool:
    """Whether every tensor of the record is already on `device` (a swap-down's records are: no copies)."""
    device = torch.device(device)
    return all(t.device == device for f in dataclasses.fields(record)
               if isinstance(t := getattr(record, f.name), Tensor))


@dataclass(frozen=True)
class LayerCalibration:
    """Activations of the full-precision layer on calibration tokens (T tokens, flat)."""

    hidden: Tensor  # [T, hidden] the layer's input, before input_layernorm
    attn_out: Tensor  # [T, Hq * D] the attention output, o_proj's input
    residual: Tensor  # [T, hidden] h = hidden + attention, before post_attention_layernorm


@contextmanager
def record_calibration(layer: torch.nn.Module) -> Iterator[list[LayerCalibration]]:
    """Capture a decoder layer's calibration activations while the caller runs the full-precision model:

        with record_calibration(model.layers[i]) as calib:
            model(...)                      # any number of forwards
        q = awq_quantize_layer(weights, calib[0], config)

    Hooks the layer's input, o_proj's input and post_attention_layernorm's input; flattens tokens."""
    seen: dict[str, list[Tensor]] = {"hidden": [], "attn_out": [], "residual": []}

    def keep(key: str):
        def hook(_module, args):
            seen[key].append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())
        return hook

    targets = {"hidden": layer, "attn_out": layer.o_proj, "residual": layer.post_attention_layernorm}
    handles = [m.register_forward_pre_hook(keep(k)) for k, m in targets.items()]
    fused = getattr(layer, "fuse_residual", None)
    if fused is not None:  # engine.model.DecoderLayer: run as modules, not with the adds fused into the norms
        layer.fuse_residual = False
    result: list[LayerCalibration] = []
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
        if fused is not None:
            layer.fuse_residual = fused
    if not seen["hidden"]:
        raise ValueError("record_calibration saw no forward pass of the layer; run the model inside the with-block")
    result.append(LayerCalibration(**{k: torch.cat(v) for k, v in seen.items()}))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _search_scale(x: Tensor, weights: list[Tensor], stat: Tensor, expand: Callable[[Tensor], Tensor],
                  group_size: int, grid: int) -> Tensor:
    """The scale (on the folding side, before `expand`) minimising the group's output MSE on x.
    x: [T, in] inputs of every linear in `weights` ([out, in] each); stat: mean |x| on the folding side."""
    refs = [x @ w.t() for w in weights]
    best_err, best_s = float("inf"), torch.ones_like(stat)
    for alpha in torch.linspace(0.0, 1.0, grid).tolist():
        s = stat.clamp_min(1e-4).pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centre around 1 so neither side over/underflows
        s_in = expand(s)
        err = sum(F.mse_loss(x @ (fake_quantize_int4(w * s_in, group_size) / s_in).t(), r).item()
                  for w, r in zip(weights, refs))
        if err < best_err:
            best_err, best_s = err, s
    return best_s


def search_awq_scales(layer: LayerWeights, calib: LayerCalibration, config: ModelConfig,
                      group_size: int = 128, grid: int = 20, max_tokens: int = 512) -> dict[str, Tensor]:
    """Per-group scales {'qkv', 'o', 'gate_up', 'down'} (see the table at the top); 'o' is per v_proj
    output channel. Uses at most `max_tokens` calibration tokens (evenly spaced)."""
    expected = {"hidden": config.hidden_size, "attn_out": config.q_size, "residual": config.hidden_size}
    for name, width in expected.items():
        t = getattr(calib, name)
        if t.dim() != 2 or t.shape[1] != width or t.shape[0] != calib.hidden.shape[0] or t.shape[0] == 0:
            raise ValueError(f"calibration {name} must be [tokens, {width}] with the same tokens as hidden "
                             f"{tuple(calib.hidden.shape)}, got {tuple(t.shape)}")
    pick = torch.linspace(0, calib.hidden.shape[0] - 1, min(max_tokens, calib.hidden.shape[0])).long()
    w = {n: t.float() for n, t in layer.linears.items()}
    b = {n: t.float() for n, t in layer.biases.items()}
    x_attn = rms_norm(calib.hidden[pick], layer.norms["input_layernorm"], config.rms_norm_eps)
    x_mlp = rms_norm(calib.residual[pick], layer.norms["post_attention_layernorm"], config.rms_norm_eps)
    x_o = calib.attn_out[pick].float()
    gate = F.linear(x_mlp, w["gate_proj"], b.get("gate_proj"))
    x_down = F.silu(gate) * F.linear(x_mlp, w["up_proj"], b.get("up_proj"))

    # o_proj input channel (head h, dim d) comes from v channel (h // heads_per_kv, d): tie their s.
    kv, d, per_kv = config.num_kv_heads, config.head_dim, config.num_heads // config.num_kv_heads
    o_stat = x_o.abs().mean(0).reshape(kv, per_kv, d).mean(1).reshape(-1)

    def o_expand(s: Tensor) -> Tensor:
        return s.reshape(kv, 1, d).expand(kv, per_kv, d).reshape(-1)

    same = lambda s: s  # noqa: E731
    return {
        "qkv": _search_scale(x_attn, [w["q_proj"], w["k_proj"], w["v_proj"]], x_attn.abs().mean(0), same, group_size, grid),
        "o": _search_scale(x_o, [w["o_proj"]], o_stat, o_expand, group_size, grid),
        "gate_up": _search_scale(x_mlp, [w["gate_proj"], w["up_proj"]], x_mlp.abs().mean(0), same, group_size, grid),
        "down": _search_scale(x_down, [w["down_proj"]], x_down.abs().mean(0), same, group_size, grid),
    }


def apply_awq_scales(layer: LayerWeights, scales: Mapping[str, Tensor], config: ModelConfig) -> LayerWeights:
    """Fold the scales into the layer: the full-precision function is unchanged (up to rounding).
    Computed in fp32; results keep each tensor's dtype."""
    w = {n: t.float().clone() for n, t in layer.linears.items()}
    b = {n: t.float().clone() for n, t in layer.biases.items()}
    norms = {n: t.float().clone() for n, t in layer.norms.items()}
    kv, d, per_kv = config.num_kv_heads, config.head_dim, config.num_heads // config.num_kv_heads
    s_o_in = scales["o"].reshape(kv, 1, d).expand(kv, per_kv, d).reshape(-1)

    norms["input_layernorm"] /= scales["qkv"]
    for n in ("q_proj", "k_proj", "v_proj"):
        w[n] *= scales["qkv"]
    w["v_proj"] /= scales["o"][:, None]
    w["o_proj"] *= s_o_in
    norms["post_attention_layernorm"] /= scales["gate_up"]
    for n in ("gate_proj", "up_proj"):
        w[n] *= scales["gate_up"]
    w["up_proj"] /= scales["down"][:, None]
    w["down_proj"] *= scales["down"]
    for n, s in (("v_proj", scales["o"]), ("up_proj", scales["down"])):
        if n in b:
            b[n] /= s
    return LayerWeights(linears={n: t.to(layer.linears[n].dtype) for n, t in w.items()},
                        norms={n: t.to(layer.norms[n].dtype) for n, t in norms.items()},
                        biases={n: t.to(layer.biases[n].dtype) for n, t in b.items()})


def quantize_layer_rtn(layer: LayerWeights, precision: Precision, group_size: int = 128) -> QuantizedLayer:
    """Plain round-to-nearest INT8 (per channel) or INT4 (group-wise) of all 7 linears."""
    if precision == Precision.INT8:
        linears = {n: quantize_int8(t) for n, t in layer.linears.items()}
    elif precision == Precision.INT4:
        linears = {n: quantize_int4(t, group_size) for n, t in layer.linears.items()}
    else:
        raise ValueError(f"quantize_layer_rtn makes int8 or int4, not {precision.value}")
    out = QuantizedLayer(precision, linears, dict(layer.norms), dict(layer.biases))
    out.check_integrity()
    return out


def awq_quantize_layer(layer: LayerWeights, calib: LayerCalibration, config: ModelConfig,
                       group_size: int = 128, grid: int = 20, max_tokens: int = 512) -> QuantizedLayer:
    """AWQ INT4 of one layer: search scales, fold them, quantize the scaled weights group-wise."""
    scales = search_awq_scales(layer, calib, config, group_size, grid, max_tokens)
    return quantize_layer_rtn(apply_awq_scales(layer, scales, config), Precision.INT4, group_size)
