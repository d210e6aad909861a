"""Layer Importance Score (LIS) profile: which layer to quantize first, second, ... (the swap order).

For candidate layer p with x = the hidden states entering p (full-precision model, calibration text),
h_p(x) its full-precision output, h^Q_p(x) its output with INT4 weights, and Q the layers already chosen:

    LTS_p = cos(h_p(x), x)                 how little the layer transforms its input
    LRS_p = cos(h_p(x), h^Q_p(x))          how well the INT4 layer reproduces it
    MDS_p = cos(f^Q, f^{Q+p})              how little the model output moves when p joins Q
    LIS_p = 0.25 LTS_p + 0.25 LRS_p + 0.5 MDS_p

f is the final hidden state after the model's last RMSNorm (what lm_head reads; cheaper than 49k-wide
logits and it fixes the logits up to one linear map). cos is the mean over calibration tokens of the
per-token cosine similarity. LTS and LRS depend on x only, so they are computed once per layer.
Greedy: Q = {}; repeatedly add the layer with the highest LIS (ties: lower id); the order of addition
is the swap order.

Why it is affordable: greedy needs O(L^2) model forwards. We keep the input of every layer under the
current Q; a candidate p changes nothing before p, so f^{Q+p} only re-runs layers p..L-1 from that
cached input (about half the work of a full forward), and after a pick only layers from the pick
onward are refreshed.

CLI: python -m engine.morph.profiler --model default --out engine/profiles/SmolLM2-135M-Instruct.lis.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model import Transformer
from engine.model_config import ModelConfig
from engine.morph.calibration import DenseRunner, as_batch, calibration_text, full_precision_pass, token_windows
from engine.precision import Precision, parse_dtype
from engine.quant.awq import LayerCalibration, LayerWeights, QuantizedLayer, awq_quantize_layer, quantize_layer_rtn

logger = logging.getLogger(__name__)
WEIGHTS = (0.25, 0.25, 0.5)  # LTS, LRS, MDS
# Quantizes layer p to INT4 given its full-precision weights and calibration activations.
Quantizer = Callable[[int, LayerWeights, LayerCalibration], QuantizedLayer]


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the per-token cosine similarity; a, b: [T, H]."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1).mean())


@dataclasses.dataclass(frozen=True)
class GreedyStep:
    layer: int
    lts: float
    lrs: float
    mds: float
    lis: float
    candidates: dict[int, float]  # LIS of every layer still available at this step (incl. the pick)


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    model: str
    num_layers: int
    steps: tuple[GreedyStep, ...]
    calibration: dict

    @property
    def order(self) -> list[int]:
        return [s.layer for s in self.steps]

    def check_integrity(self) -> None:
        if sorted(self.order) != list(range(self.num_layers)):
            raise ValueError(f"profile order {self.order} is not a permutation of 0..{self.num_layers - 1}")

    def to_dict(self) -> dict:
        scores = [{"layer": s.layer, "LTS": s.lts, "LRS": s.lrs, "MDS": s.mds, "LIS": s.lis,
                   "candidates": {str(k): v for k, v in s.candidates.items()}} for s in self.steps]
        return {"model": self.model, "num_layers": self.num_layers, "order": self.order,
                "scores": scores, "calibration": self.calibration}

    def write(self, path: Path) -> None:
        self.check_integrity()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")


class LayerSwitch:
    """Puts layers into their quantized variant (INT4 here; INT8 too in ops/quality) and back; keeps the
    full-precision modules, so a restore is exact. Variants are built once, on the model's device."""

    def __init__(self, model: Transformer, quantized: dict[int, QuantizedLayer]):
        self.model = model
        device = model.device
        self.full = {i: (model.layers[i].get_linears(), model.layers[i].get_norm_weights()) for i in quantized}
        self.variants = {i: (q.build_linears(device), {n: t.to(device, model.dtype) for n, t in q.norms.items()})
                     for i, q in quantized.items()}

    def quantize(self, i: int) -> None:
        self.model.layers[i].set_weights(*self.variants[i])

    def restore(self, i: int) -> None:
        self.model.layers[i].set_weights(*self.full[i])


def quantize_all(model: Transformer, calib: Sequence[LayerCalibration], quantize: "Quantizer") -> dict[int, QuantizedLayer]:
    """Every layer's quantized variant, from its full-precision weights and calibration activations.
    Quantizers run on CPU (AWQ's calibration activations are kept there)."""
    return {i: quantize(i, LayerWeights.of_layer(layer, "cpu"), calib[i]) for i, layer in enumerate(model.layers)}


def profile_layers(model: Transformer, tokens: torch.Tensor, quantize: Quantizer, model_name: str = "",
                   calibration: dict | None = None, mds_sequences: int | None = None) -> LayerProfile:
    """Greedy LIS over all layers of `model` on calibration `tokens` [B, S]. LTS, LRS and the INT4
    quantization (AWQ) see all B sequences; MDS, which costs O(L^2) forwards, sees the first
    `mds_sequences` of them (default: all). The model is left exactly as it was (every layer full
    precision) when this returns, also on error."""
    num_seqs, seq_len = tokens.shape
    mds_sequences = num_seqs if mds_sequences is None else mds_sequences
    if not 1 <= mds_sequences <= num_seqs:
        raise ValueError(f"mds_sequences must be in 1..{num_seqs} (the calibration sequences), got {mds_sequences}")
    start = time.perf_counter()
    num_layers = model.config.num_layers
    runner, inputs, calib = full_precision_pass(model, tokens)
    with torch.inference_mode():
        switch = LayerSwitch(model, quantize_all(model, calib, quantize))
        lts = {p: token_cosine(inputs[p + 1], inputs[p]) for p in range(num_layers)}
        lrs = {}
        for p in range(num_layers):
            switch.quantize(p)
            try:
                lrs[p] = token_cosine(inputs[p + 1], runner.run_layer(p, inputs[p]))
            finally:
                switch.restore(p)
        chosen: list[int] = []
        try:
            rows = mds_sequences * seq_len  # sequence i is rows [i * S, (i + 1) * S)
            steps = _greedy(DenseRunner(model, mds_sequences, seq_len), switch, [x[:rows] for x in inputs],
                            lts, lrs, chosen)
        finally:
            for p in chosen:
                switch.restore(p)
    info = dict(calibration or {})
    if isinstance(quantize, Int4Quantizer):
        info.update(quantizer=quantize.method, int4_group_size=quantize.group_size,
                    **({"awq_grid": quantize.awq_grid} if quantize.method == "awq" else {}))
    info.update(sequences=num_seqs, seq_len=seq_len, tokens=int(tokens.numel()), mds_sequences=mds_sequences,
                dtype=str(model.dtype).removeprefix("torch."), cosine="mean over tokens of per-token cosine",
                model_output="final hidden state after the last RMSNorm", weights=dict(zip(("LTS", "LRS", "MDS"), WEIGHTS)),
                seconds=round(time.perf_counter() - start, 1))
    profile = LayerProfile(model_name, num_layers, tuple(steps), info)
    profile.check_integrity()
    return profile


def _greedy(runner: DenseRunner, switch: LayerSwitch, cache: list[torch.Tensor], lts: dict[int, float],
            lrs: dict[int, float], chosen: list[int]) -> list[GreedyStep]:
    """cache[l] = input of layer l with the layers in `chosen` quantized (cache[L] = last output).
    Appends each pick to `chosen` (and leaves it quantized) so the caller can restore on error."""
    num_layers = len(cache) - 1
    remaining, steps = list(range(num_layers)), []
    while remaining:
        reference = runner.final(cache[num_layers])
        mds, lis = {}, {}
        for p in remaining:
            switch.quantize(p)
            try:
                mds[p] = token_cosine(reference, runner.final(runner.run_layers(cache[p], p)))
            finally:
                switch.restore(p)
            lis[p] = WEIGHTS[0] * lts[p] + WEIGHTS[1] * lrs[p] + WEIGHTS[2] * mds[p]
        best = max(remaining, key=lambda p: (lis[p], -p))
        steps.append(GreedyStep(best, lts[best], lrs[best], mds[best], lis[best], dict(lis)))
        logger.info("step %d: layer %d LIS %.5f (MDS %.5f)", len(steps), best, lis[best], mds[best])
        switch.quantize(best)
        chosen.append(best)
        remaining.remove(best)
        for layer in range(best, num_layers):  # only what follows the pick changes
            cache[layer + 1] = runner.run_layer(layer, cache[layer])
    return steps


@dataclasses.dataclass(frozen=True)
class Int4Quantizer:
    """INT4 a layer the way the host store does: 'awq' (the project's AWQ, the store's default) or
    'rtn' (plain group-wise round-to-nearest). Any callable with this signature works as a Quantizer,
    e.g. `lambda i, w, c: store.read(i, Precision.INT4)` to profile a store's own variants."""
    method: str
    config: ModelConfig
    group_size: int = 128
    awq_grid: int = 6  # alphas searched; the host store's default (prepare.StoreSpec.awq_grid)

    def __post_init__(self) -> None:
        if self.method not in ("awq", "rtn"):
            raise ValueError(f"unknown quantizer {self.method!r}; use 'awq' or 'rtn'")

    def __call__(self, i: int, weights: LayerWeights, calib: LayerCalibration) -> QuantizedLayer:
        if self.method == "awq":
            return awq_quantize_layer(weights, calib, self.config, self.group_size, self.awq_grid)
        return quantize_layer_rtn(weights, Precision.INT4, self.group_size)


def make_quantizer(method: str, config: ModelConfig, group_size: int = 128, awq_grid: int = 6) -> Int4Quantizer:
    return Int4Quantizer(method, config, group_size, awq_grid)


def main(argv: Sequence[str] | None = None) -> None:
    from engine.loader import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default', a .gguf file or a Hugging Face folder")
    ap.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    ap.add_argument("--calibration", default="sharegpt",
                    help="'sharegpt', 'wikitext2' (its first half) or a text file (its first half)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--mds-sequences", type=int, default=1,
                    help="calibration sequences the greedy MDS uses (its cost is O(L^2) forwards)")
    ap.add_argument("--dtype", default="fp32", help="precision of the full-precision model while profiling")
    ap.add_argument("--quantizer", choices=("awq", "rtn"), default="awq")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--awq-grid", type=int, default=6, help="AWQ alphas searched (the host store uses 6)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--cache-dir", type=Path, default=None, help="model cache (default $MORPHSERVE_CACHE)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, parse_dtype(args.dtype), args.device, args.cache_dir)
    text = calibration_text(args.calibration)
    tokens = as_batch(token_windows(loaded.tokenizer, text.text, args.sequences, args.seq_len))
    quantizer = make_quantizer(args.quantizer, loaded.config, args.group_size, args.awq_grid)
    profile = profile_layers(loaded.model, tokens, quantizer, loaded.files.name, text.describe(), args.mds_sequences)
    profile.write(args.out)
    print(f"{loaded.files.name}: swap order {profile.order} ({profile.calibration['seconds']} s) -> {args.out}")


if __name__ == "__main__":
    main()
