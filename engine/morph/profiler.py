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

from engine.layers.attention import AttentionMetadata, PrefillChunk
from engine.model import Transformer
from engine.model_config import ModelConfig
from engine.morph.prepare import CALIBRATION_TEXT
from engine.precision import Precision, parse_dtype
from engine.quant.awq import (LayerCalibration, LayerWeights, QuantizedLayer, awq_quantize_layer, quantize_layer_rtn,
                              record_calibration)

logger = logging.getLogger(__name__)
WEIGHTS = (0.25, 0.25, 0.5)  # LTS, LRS, MDS
DEFAULT_TEXT = CALIBRATION_TEXT  # ../shared/text/wikitext-2-valid.txt beside the repository
# Quantizes layer p to INT4 given its full-precision weights and calibration activations.
Quantizer = Callable[[int, LayerWeights, LayerCalibration], QuantizedLayer]


def token_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over tokens of the per-token cosine similarity; a, b: [T, H]."""
    return float(F.cosine_similarity(a.float(), b.float(), dim=-1).mean())


def text_half(path: Path, half: str) -> str:
    """The first ("calibration") or second ("evaluation") half of a text file, split at the middle
    line, so calibration and evaluation never share a line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    mid = len(lines) // 2
    if half not in ("first", "second"):
        raise ValueError(f"half must be 'first' or 'second', got {half!r}")
    return "".join(lines[:mid] if half == "first" else lines[mid:])


class DenseRunner:
    """Runs B whole sequences of S tokens through a Transformer layer by layer, without a paged cache:
    every sequence is a prefill chunk at position 0, so attention uses its fresh K/V only and the
    K/V written to the scratch cache (one block of T slots, shared by all layers) is never read."""

    def __init__(self, model: Transformer, num_seqs: int, seq_len: int):
        if seq_len > model.max_positions:
            raise ValueError(f"seq_len {seq_len} exceeds the model's {model.max_positions} positions")
        self.model, t = model, num_seqs * seq_len
        device, c = model.embed_weight.device, model.config
        self.positions = torch.arange(seq_len, device=device).repeat(num_seqs)  # [T]
        self.meta = AttentionMetadata(
            write_blocks=torch.zeros(t, dtype=torch.long, device=device),
            write_offsets=torch.arange(t, device=device), decode=None,
            prefills=tuple(PrefillChunk(i * seq_len, (i + 1) * seq_len, 0, None, None) for i in range(num_seqs)))
        scratch = torch.empty(1, t, c.num_kv_heads, c.head_dim, dtype=model.dtype, device=device)
        self.kv = (scratch, torch.empty_like(scratch))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [B, S] long -> [T, H]."""
        return F.embedding(tokens.reshape(-1).to(self.model.embed_weight.device), self.model.embed_weight)

    def run_layer(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[i](x, self.positions, self.model.rotary, self.meta, self.kv)

    def run_layers(self, x: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        for i in range(start, self.model.config.num_layers if stop is None else stop):
            x = self.run_layer(i, x)
        return x

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final hidden state (after the last RMSNorm): [T, H]."""
        return self.model.norm(x)


def layer_weights(model: Transformer, i: int, device: str | torch.device | None = None) -> LayerWeights:
    """Layer i's current (full-precision) tensors as a LayerWeights record (no copies unless moved)."""
    linears = model.layers[i].get_linears()
    move = (lambda t: t) if device is None else (lambda t: t.to(device))
    return LayerWeights(linears={n: move(lin.weight) for n, lin in linears.items()},
                        norms={n: move(t) for n, t in model.layers[i].get_norm_weights().items()},
                        biases={n: move(lin.bias) for n, lin in linears.items() if lin.bias is not None})


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
        device = model.embed_weight.device
        self.full = {i: (model.layers[i].get_linears(), model.layers[i].get_norm_weights()) for i in quantized}
        self.variants = {i: (q.build_linears(device), {n: t.to(device, model.dtype) for n, t in q.norms.items()})
                     for i, q in quantized.items()}

    def quantize(self, i: int) -> None:
        self.model.layers[i].set_weights(*self.variants[i])

    def restore(self, i: int) -> None:
        self.model.layers[i].set_weights(*self.full[i])


def full_precision_pass(runner: DenseRunner, x0: torch.Tensor, quantize: Quantizer,
                         ) -> tuple[list[torch.Tensor], dict[int, QuantizedLayer]]:
    """Inputs of every layer (inputs[L] = last layer's output) and each layer's INT4 variant,
    quantized from the activations that this very pass records."""
    model, inputs, quantized = runner.model, [x0], {}
    for i in range(model.config.num_layers):
        with record_calibration(model.layers[i]) as calib:
            inputs.append(runner.run_layer(i, inputs[i]))
        # Quantizers run on CPU (AWQ's calibration activations are kept there); a no-op on CPU.
        quantized[i] = quantize(i, layer_weights(model, i, "cpu"), calib[0])
    return inputs, quantized


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
    runner = DenseRunner(model, num_seqs, seq_len)
    with torch.inference_mode():
        inputs, quantized = full_precision_pass(runner, runner.embed(tokens), quantize)
        switch = LayerSwitch(model, quantized)
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


def calibration_tokens(token_ids: Sequence[int], num_seqs: int, seq_len: int) -> torch.Tensor:
    """The first num_seqs * seq_len tokens as [num_seqs, seq_len]."""
    need = num_seqs * seq_len
    if len(token_ids) < need:
        raise ValueError(f"the calibration text has {len(token_ids)} tokens, {need} are needed "
                         f"({num_seqs} x {seq_len}); lower --sequences / --seq-len")
    return torch.tensor(list(token_ids[:need]), dtype=torch.long).view(num_seqs, seq_len)


def load_model(spec: str, dtype: torch.dtype, device: str = "cpu"):
    """(served name, hf folder, Transformer) for 'default', a .gguf file or a Hugging Face folder."""
    from engine.config import default_cache_dir
    from engine.loader import load_config, load_weights, resolve_model
    from engine.model import build_model

    files = resolve_model(spec, default_cache_dir())
    model = build_model(load_config(files.hf_dir), load_weights(files.hf_dir, dtype), dtype, device)
    return files.name, files.hf_dir, model


def main(argv: Sequence[str] | None = None) -> None:
    from engine.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default', a .gguf file or a Hugging Face folder")
    ap.add_argument("--out", type=Path, required=True, help="where to write the profile JSON")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="calibration text; its FIRST half is used")
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    name, hf_dir, model = load_model(args.model, parse_dtype(args.dtype), args.device)
    ids = Tokenizer.from_dir(hf_dir).encode(text_half(args.text, "first"))
    tokens = calibration_tokens(ids, args.sequences, args.seq_len)
    quantizer = make_quantizer(args.quantizer, model.config, args.group_size, args.awq_grid)
    calibration = {"file": str(args.text), "text": "first half (by lines)"}
    profile = profile_layers(model, tokens, quantizer, name, calibration, args.mds_sequences)
    profile.write(args.out)
    print(f"{name}: swap order {profile.order} ({profile.calibration['seconds']} s) -> {args.out}")


if __name__ == "__main__":
    main()
