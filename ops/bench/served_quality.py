"""After the load phase (servers stopped): answer quality of what every run actually served.

- Teacher-forced top-1 agreement with the full-precision model (ops/quality/teacher_forced.py) for
  every ok response: the prompt as the server tokenized it (the model's chat template, no special
  tokens added) and the served text re-tokenized (the servers stream text, not ids; where the
  re-tokenization differs from the generated ids, that position can count as a disagreement for
  every system alike).
- WikiText-2 perplexity of every configuration (precision of each layer) that served tokens, with
  the INT8/INT4 variants read from the same host store the servers swap from, and per run the
  token-weighted perplexity of the configurations it served with.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ops.bench.loadgen import ServerSample
from ops.quality.teacher_forced import (ForcedSequence, agreement, pooled, predictions,
                                        token_weighted_perplexity, tokens_by_config)

logger = logging.getLogger(__name__)
FULL = "full"  # configuration label when every layer is at full precision


@dataclasses.dataclass(frozen=True)
class ServedQuality:
    agreement: float | None  # pooled over every served position of the run
    positions: int
    weighted_perplexity: float | None
    tokens_by_config: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class RunServed:
    """What the quality phase needs from one run."""
    key: str  # "<system>/r<repeat>"
    prompts: Mapping[str, str]  # request id -> prompt text (user message)
    outputs: Mapping[str, str]  # request id -> served text (ok requests)
    token_times: Sequence[float]
    timeline: Sequence[ServerSample]


def config_label(precisions: Sequence[str], full: str) -> str:
    """'full' or e.g. 'int4:3,7,12;int8:5' (layer indices per lower precision)."""
    lower: dict[str, list[int]] = {}
    for i, p in enumerate(precisions):
        if p != full:
            lower.setdefault(p, []).append(i)
    return ";".join(f"{p}:{','.join(map(str, ids))}" for p, ids in sorted(lower.items())) or FULL


def parse_label(label: str) -> dict[int, str]:
    if label == FULL:
        return {}
    out = {}
    for part in label.split(";"):
        precision, ids = part.split(":")
        out.update({int(i): precision for i in ids.split(",")})
    return out


def run_configs(run: RunServed) -> tuple[list[float], list[str]]:
    points = [(s.t_s, s.labels["config"]) for s in sorted(run.timeline, key=lambda s: s.t_s) if "config" in s.labels]
    return ([t for t, _ in points], [c for _, c in points]) if points else ([0.0], [FULL])


def evaluate_runs(runs: Sequence[RunServed], model_spec: str, budget_bytes: int, engine_knobs: Mapping,
                  threads: int, ppl_tokens: int, ppl_window: int, max_batch_tokens: int = 4096) -> dict[str, ServedQuality]:
    from engine import datasets
    from engine.config import EngineConfig
    from engine.loader import load_model
    from engine.morph.calibration import DenseRunner

    torch.set_num_threads(threads)
    loaded = load_model(model_spec, torch.bfloat16)
    name, hf_dir, model, tokenizer = loaded.files.name, loaded.files.hf_dir, loaded.model, loaded.tokenizer

    def hidden(tokens: torch.Tensor) -> torch.Tensor:
        runner = DenseRunner(model, *tokens.shape)
        return runner.run_layers(runner.embed(tokens), 0)

    seqs, by_run = _sequences(runs, tokenizer, model.max_positions)
    unique = list({(s.prompt_ids, s.served_ids): s for s in seqs}.values())  # repeats often serve the same text
    logger.info("teacher forcing %d sequences (%d distinct)", len(seqs), len(unique))
    predicted = predictions(hidden, model.compute_logits, unique, max_batch_tokens)
    by_ids = {(s.prompt_ids, s.served_ids): predicted[s.key] for s in unique}
    configs = {run.key: run_configs(run) for run in runs}
    counts = {run.key: tokens_by_config(run.token_times, *configs[run.key]) for run in runs}
    needed = sorted({c for per_run in counts.values() for c in per_run})
    config = EngineConfig(model=model_spec, memory_budget=budget_bytes, **dict(engine_knobs))
    ppl = config_perplexities(model, needed, config, name, hf_dir, tokenizer,
                              tokenizer.encode(datasets.text_half(datasets.resolve("wikitext2"), "second"))[:ppl_tokens],
                              ppl_window)
    out = {}
    for run in runs:
        total = pooled([agreement(s, by_ids[(s.prompt_ids, s.served_ids)]) for s in by_run[run.key]])
        out[run.key] = ServedQuality(total.rate, total.positions, token_weighted_perplexity(ppl, counts[run.key]),
                                     counts[run.key])
    return out


def _sequences(runs: Sequence[RunServed], tokenizer, max_len: int):
    seqs, by_run = [], {}
    for run in runs:
        mine = []
        for rid, text in run.outputs.items():
            prompt = tuple(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": run.prompts[rid]}])))
            served = tuple(tokenizer.encode(text))[:max(0, max_len - len(prompt))]
            if served:
                mine.append(ForcedSequence(f"{run.key}/{rid}", prompt, served))
        by_run[run.key] = mine
        seqs += mine
    return seqs, by_run


def config_perplexities(model, labels: Sequence[str], config, name: str, hf_dir: Path, tokenizer,
                        eval_ids: Sequence[int], window: int) -> dict[str, float]:
    """WikiText-2 perplexity of each configuration label, with the host store's variants."""
    from engine.morph.profiler import LayerSwitch
    from engine.morph.store_builder import ensure_host_store, store_spec_for
    from engine.precision import Precision
    from ops.quality.perplexity import perplexity

    wanted = {layer: p for label in labels for layer, p in parse_label(label).items()}
    switches = {}
    if wanted:
        store = ensure_host_store(model, store_spec_for(config, name, hf_dir), config.cache_path, tokenizer)
        for precision in {p for label in labels for p in parse_label(label).values()}:
            layers = {i for label in labels for i, p in parse_label(label).items() if p == precision}
            switches[precision] = LayerSwitch(model, {i: store.read(i, Precision(precision)) for i in sorted(layers)})
    out = {}
    for label in labels:
        chosen = parse_label(label)
        try:
            for i, p in chosen.items():
                switches[p].quantize(i)
            out[label] = perplexity(model, eval_ids, window)
        finally:
            for i, p in chosen.items():
                switches[p].restore(i)
        logger.info("perplexity %.3f for %s", out[label], label)
    return out
