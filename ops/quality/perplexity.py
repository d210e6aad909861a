"""WikiText-2 perplexity of the model with some of its layers quantized, run directly (no server).

Evaluation text: the SECOND half (by lines) of WikiText-2's validation split (engine/datasets.py finds
or downloads it); calibration on WikiText-2 uses the first half, so the two never overlap. The first `--tokens` tokens of that half are
cut into non-overlapping windows of `--window` tokens; each window starts a fresh context, and every
token but a window's first is predicted. Perplexity = exp(mean NLL over all predicted tokens).

Configurations (quantized layers set with DecoderLayer.set_weights, then restored):
    full precision; all layers INT8 (RTN, per channel); all layers INT4;
    N layers INT4 chosen by the LIS profile, front-to-back, and at random (mean of 3 seeds), N = 8, 15.
INT4 uses the host store's quantizer (the project's AWQ by default, calibrated on the host store's
default text, ShareGPT conversations; --calibration-text wikitext2 takes WikiText-2's first half).

    python -m ops.quality.perplexity --model default --out perplexity.json
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import datasets
from engine.model import Transformer
from engine.morph.calibration import DenseRunner, as_batch, calibration_text, full_precision_pass, token_windows
from engine.morph.profiler import LayerSwitch, make_quantizer, quantize_all
from engine.precision import Precision, parse_dtype
from engine.quant.awq import LayerWeights, QuantizedLayer, quantize_layer_rtn

logger = logging.getLogger(__name__)
RANDOM_SEEDS = (0, 1, 2)


def window_nll(model: Transformer, windows: torch.Tensor) -> tuple[float, int]:
    """windows: [W, S] token ids -> (sum of NLL of tokens 1..S-1 of each window, their count)."""
    w, s = windows.shape
    runner = DenseRunner(model, w, s)
    with torch.inference_mode():
        logits = model.compute_logits(runner.run_layers(runner.embed(windows), 0))  # [W * S, V] fp32
    logits = logits.view(w, s, -1)[:, :-1]
    targets = windows[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return float(nll), targets.numel()


def perplexity(model: Transformer, token_ids: Sequence[int], window: int = 512, batch_windows: int = 2) -> float:
    """exp(mean NLL) over the non-overlapping `window`-token windows of `token_ids` (a trailing partial
    window is dropped)."""
    num_windows = len(token_ids) // window
    if num_windows == 0:
        raise ValueError(f"need at least one window of {window} tokens, got {len(token_ids)} tokens")
    windows = torch.tensor(list(token_ids[:num_windows * window]), dtype=torch.long).view(num_windows, window)
    total, count = 0.0, 0
    for i in range(0, num_windows, batch_windows):  # a few windows at a time: logits are [T, vocab]
        nll, n = window_nll(model, windows[i:i + batch_windows])
        total, count = total + nll, count + n
    return math.exp(total / count)


def perplexity_with(model: Transformer, switch: LayerSwitch, layers: Sequence[int], token_ids: Sequence[int],
                    window: int) -> float:
    """Perplexity with `layers` switched to their quantized variants (restored afterwards)."""
    try:
        for i in layers:
            switch.quantize(i)
        ppl = perplexity(model, token_ids, window)
        logger.info("%d layers %s -> perplexity %.3f", len(layers), list(layers), ppl)
        return ppl
    finally:
        for i in layers:
            switch.restore(i)


def quantized_variants(model: Transformer, calib: torch.Tensor, int4_method: str,
                       ) -> tuple[dict[int, QuantizedLayer], dict[int, QuantizedLayer]]:
    """Every layer in RTN INT8 and in INT4 (AWQ calibrated on `calib` [B, S], or RTN), as the host store
    builds them."""
    _, _, activations = full_precision_pass(model, calib)
    int4 = quantize_all(model, activations, make_quantizer(int4_method, model.config))
    int8 = {i: quantize_layer_rtn(LayerWeights.of_layer(layer), Precision.INT8) for i, layer in enumerate(model.layers)}
    return int8, int4


def store_variants(path: Path) -> tuple[dict[int, QuantizedLayer], dict[int, QuantizedLayer]]:
    """Every layer's INT8 and INT4 variant exactly as a built host store serves them."""
    from engine.morph.host_store import HostStore

    store = HostStore(path)
    return ({i: store.read(i, Precision.INT8) for i in range(store.num_layers)},
            {i: store.read(i, Precision.INT4) for i in range(store.num_layers)})


def layer_orders(num_layers: int, lis_order: Sequence[int]) -> dict[str, list[int]]:
    orders = {"lis": list(lis_order), "front-to-back": list(range(num_layers))}
    for seed in RANDOM_SEEDS:
        orders[f"random-{seed}"] = random.Random(seed).sample(range(num_layers), num_layers)
    return orders


def evaluate(model: Transformer, int8: dict[int, QuantizedLayer], int4: dict[int, QuantizedLayer],
             lis_order: Sequence[int], token_ids: Sequence[int], window: int, counts: Sequence[int]) -> dict:
    """Every configuration's perplexity: {"full": ppl, "int8-all": ..., "int4-all": ...,
    "int4-<n>": {"lis": ..., "front-to-back": ..., "random": mean, "random-<seed>": ...}}."""
    num_layers = model.config.num_layers
    s8, s4 = LayerSwitch(model, int8), LayerSwitch(model, int4)
    everything = list(range(num_layers))
    out: dict = {"full": perplexity_with(model, s4, [], token_ids, window),
                 "int8-all": perplexity_with(model, s8, everything, token_ids, window),
                 "int4-all": perplexity_with(model, s4, everything, token_ids, window)}
    for n in counts:
        row = {name: perplexity_with(model, s4, order[:n], token_ids, window)
               for name, order in layer_orders(num_layers, lis_order).items()}
        row["random"] = statistics.mean(row[f"random-{s}"] for s in RANDOM_SEEDS)
        out[f"int4-{n}"] = row
    return out


def format_table(results: dict, counts: Sequence[int]) -> str:
    lines = [f"{'configuration':<36}{'perplexity':>12}",
             f"{'full precision':<36}{results['full']:>12.3f}",
             f"{'all layers INT8':<36}{results['int8-all']:>12.3f}",
             f"{'all layers INT4':<36}{results['int4-all']:>12.3f}"]
    for n in counts:
        row = results[f"int4-{n}"]
        for name in ("lis", "front-to-back", "random"):
            label = f"{n} layers INT4, {name}" + (" (mean of 3)" if name == "random" else "")
            lines.append(f"{label:<36}{row[name]:>12.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    from engine.loader import load_model
    from engine.morph.swap_order import committed_profile_path, load_swap_order

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", type=Path, default=Path("perplexity.json"))
    ap.add_argument("--text", type=Path, default=None, help="evaluation text (its second half); default WikiText-2")
    ap.add_argument("--tokens", type=int, default=4096, help="evaluation tokens from the start of the second half")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 15], help="INT4 layer counts to compare orders at")
    ap.add_argument("--profile", type=Path, default=None, help="LIS profile JSON; default: the committed one")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--quantizer", choices=("awq", "rtn"), default="awq")
    ap.add_argument("--calibration", type=int, nargs=2, default=[4, 128], metavar=("SEQS", "LEN"),
                    help="token windows AWQ calibrates on (the profiler's defaults)")
    ap.add_argument("--calibration-text", default="sharegpt", help="sharegpt, wikitext2 or a text file")
    ap.add_argument("--store", type=Path, default=None,
                    help="a built host store folder: take its INT8 / INT4 variants instead of quantizing here")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    loaded = load_model(args.model, parse_dtype(args.dtype), args.device)
    name, model, tokenizer = loaded.files.name, loaded.model, loaded.tokenizer
    profile_path = args.profile or committed_profile_path(name)
    lis_order = load_swap_order(profile_path, model.config.num_layers, name).order
    text_path = datasets.resolve("wikitext2", args.text)
    eval_ids = tokenizer.encode(datasets.text_half(text_path, "second"))[:args.tokens]
    if len(eval_ids) < args.tokens:
        raise SystemExit(f"the second half has only {len(eval_ids)} tokens; lower --tokens")
    if args.store is not None:
        int8, int4 = store_variants(args.store)
        quantizer = f"host store {args.store}"
    else:
        text = calibration_text(args.calibration_text)
        calib = as_batch(token_windows(tokenizer, text.text, *args.calibration))
        int8, int4 = quantized_variants(model, calib, args.quantizer)
        quantizer = f"{args.quantizer} on {text.source}"
    results = evaluate(model, int8, int4, lis_order, eval_ids, args.window, args.layers)
    report = {"model": name, "dtype": args.dtype, "text": f"{text_path} (second half by lines)",
              "tokens": len(eval_ids), "window": args.window, "int4_quantizer": quantizer,
              "int8_quantizer": "rtn per-channel", "profile": str(profile_path), "lis_order": list(lis_order),
              "random_seeds": list(RANDOM_SEEDS), "results": results,
              "seconds": round(time.perf_counter() - start, 1)}
    args.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(format_table(results, args.layers))
    print(f"{len(eval_ids)} tokens, {args.window}-token windows, {args.dtype}, INT4 {quantizer}; "
          f"{report['seconds']} s -> {args.out}")


if __name__ == "__main__":
    main()
