"""Build a model's host store once: every layer in every precision of the ladder, on disk.

`ensure_host_store` opens the store a StoreSpec names, building it first when it does not exist.
Building is atomic (written into a temp folder, renamed into place) and locked (two replicas starting
together build once; the second waits and reuses).

INT4 comes from, in order: an AWQ / compressed-tensors checkpoint when configured; RTN when the
calibration is "none"; otherwise the project's own AWQ on token windows of the configured calibration
text (engine/morph/calibration.py; a source that cannot be had is an error, never a silent RTN). The
manifest records the method and the calibration source; both are part of the store's key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.cache_lock import exclusive_build
from engine.errors import ModelLoadError
from engine.layers.linear import tensor_nbytes
from engine.model import Transformer
from engine.morph.calibration import as_batch, calibration_text, full_precision_pass, token_windows
from engine.morph.host_store import (MANIFEST, STORE_VERSION, HostStore, StoredLayer, StoreManifest, encode_layer,
                                     layer_file_name, store_root)
from engine.precision import Precision, full_precision_for
from engine.quant import quantized_nbytes
from engine.quant.awq import LayerCalibration, LayerWeights, awq_quantize_layer, quantize_layer_rtn
from engine.quant.checkpoints import load_int4_layer, open_int4_checkpoint
from engine.quant.int4_kernel import cpu_layout


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Everything a store's bytes depend on; its hash names the store folder."""
    model_name: str
    hf_dir: Path
    full: Precision
    ladder: tuple[Precision, ...]  # the lower rungs, e.g. (INT8, INT4)
    int4_group_size: int = 128
    int4_checkpoint: Path | None = None
    calibration: str = "sharegpt"  # "sharegpt" | "wikitext2" | "none" | a text file (calibration.py)
    # Small on purpose: the default model builds on first start and in CI, on CPU. 256 tokens and 6
    # alphas (0 = RTN included, so AWQ never does worse than RTN on them) keep it to about a minute.
    calibration_seqs: int = 4
    calibration_len: int = 64
    awq_grid: int = 6


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """How the INT4 rung is made, decided before anything is built."""
    method: str  # "awq" | "rtn" | "checkpoint:<dir>"
    token_ids: tuple[tuple[int, ...], ...] = ()  # AWQ's calibration windows
    calibration: dict = dataclasses.field(default_factory=dict)  # for the manifest


def store_spec_for(config, model_name: str, hf_dir: Path) -> StoreSpec:
    """The spec an EngineConfig implies (the engine and the prepare CLI must agree, or they build twice)."""
    ckpt = config.int4_checkpoint
    return StoreSpec(model_name=model_name, hf_dir=Path(hf_dir), full=full_precision_for(config.torch_dtype),
                     ladder=config.ladder, int4_group_size=config.int4_group_size,
                     int4_checkpoint=Path(ckpt).expanduser().resolve() if ckpt else None,
                     calibration=config.calibration)


def plan_build(spec: StoreSpec, tokenizer, calibration_ids: Sequence[Sequence[int]] | None = None) -> BuildPlan:
    """The INT4 method and its calibration windows (`calibration_ids` replaces the text's, for tests)."""
    if spec.int4_checkpoint is not None and Precision.INT4 in spec.ladder:
        return BuildPlan(f"checkpoint:{spec.int4_checkpoint}", calibration={"reason": "INT4 from the checkpoint"})
    if Precision.INT4 not in spec.ladder:
        return BuildPlan("rtn", calibration={"reason": "no INT4 rung in the ladder"})
    if calibration_ids is not None:
        ids, info = calibration_ids, {"source": "token ids given by the caller"}
    elif spec.calibration == "none":
        return BuildPlan("rtn", calibration={"source": "none", "reason": "calibration='none': INT4 by round-to-nearest"})
    else:
        text = calibration_text(spec.calibration)
        ids, info = token_windows(tokenizer, text.text, spec.calibration_seqs, spec.calibration_len), text.describe()
    ids = tuple(tuple(int(t) for t in s) for s in ids)
    info.update(sequences=len(ids), tokens=sum(map(len, ids)), grid=spec.awq_grid)
    return BuildPlan("awq", ids, info)


def _files_identity(folder: Path | None) -> list:
    """Cheap identity of a model folder: config.json's text and each weight file's size and mtime."""
    if folder is None:
        return []
    folder = Path(folder)
    config = folder / "config.json"
    ident = [config.read_text(encoding="utf-8") if config.is_file() else None]
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        ident.append((f.name, st.st_size, st.st_mtime_ns))
    return ident


def fingerprint(spec: StoreSpec, plan: BuildPlan) -> str:
    key = {"version": STORE_VERSION, "model": _files_identity(spec.hf_dir), "full": spec.full.value,
           "ladder": [p.value for p in spec.ladder], "group": spec.int4_group_size, "method": plan.method,
           "checkpoint": [str(spec.int4_checkpoint), _files_identity(spec.int4_checkpoint)],
           # the source by name, and its token windows (which cover the text and the lengths)
           "calibration": [plan.calibration.get("source"), [list(s) for s in plan.token_ids], spec.awq_grid],
           "int4_cpu_layout": cpu_layout() if Precision.INT4 in spec.ladder else None}  # the stored kernel bytes
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def resident_bytes(stored: StoredLayer) -> int:
    """Bytes the layer's 7 linears will hold once built (what `DecoderLayer.weight_bytes` reports)."""
    bias = {n: tensor_nbytes(b) for n, b in stored.biases.items()}
    if isinstance(stored, LayerWeights):
        return sum(tensor_nbytes(w) for w in stored.linears.values()) + sum(bias.values())
    total = 0
    for n, rec in stored.linears.items():
        group = getattr(rec, "group_size", 128)
        b = stored.biases.get(n)
        total += quantized_nbytes(stored.precision, rec.out_features, rec.in_features, group,
                                  bias_dtype=None if b is None else b.dtype)
    return total


def _variants(model: Transformer, spec: StoreSpec, method: str, calib: list[LayerCalibration] | None, ckpt):
    """Yield (layer, {precision: StoredLayer}) one layer at a time, to keep peak memory at one layer."""
    for i in range(model.config.num_layers):
        full = LayerWeights.of_layer(model.layers[i])
        out: dict[Precision, StoredLayer] = {spec.full: full}
        cpu_full = LayerWeights.of_layer(model.layers[i], "cpu")
        for p in spec.ladder:
            if p == Precision.INT4 and method.startswith("checkpoint"):
                try:
                    out[p] = load_int4_layer(ckpt[1], ckpt[0], model.config, i, dtype=model.dtype)
                except ModelLoadError as e:
                    raise ModelLoadError(f"INT4 checkpoint {spec.int4_checkpoint} does not fit model "
                                         f"{spec.model_name} at layer {i}: {e}") from e
            elif p == Precision.INT4 and method == "awq":
                out[p] = awq_quantize_layer(cpu_full, calib[i], model.config, spec.int4_group_size, grid=spec.awq_grid)
            else:
                out[p] = quantize_layer_rtn(cpu_full, p, spec.int4_group_size)
        yield i, out


def build_store(model: Transformer, spec: StoreSpec, dest: Path, plan: BuildPlan, fp: str) -> StoreManifest:
    """Write every layer in every precision into `dest` (a fresh folder), manifest last."""
    t0 = time.perf_counter()
    dest.mkdir(parents=True)
    # Small matrices do not amortise thread synchronisation: on the shared 2-core CI box SmolLM2's
    # build took 537 s with 2 threads and 42 s with 1. Big models (hidden >= 2048) keep more threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, model.config.hidden_size // 1024)))
    try:
        calib = full_precision_pass(model, as_batch(plan.token_ids))[2] if plan.method == "awq" else None
        ckpt = open_int4_checkpoint(spec.int4_checkpoint) if plan.method.startswith("checkpoint") else None
        layer_bytes, groups = [], {}
        for i, variants in _variants(model, spec, plan.method, calib, ckpt):
            layer_bytes.append({p.value: resident_bytes(v) for p, v in variants.items()})
            for p, v in variants.items():
                tensors, metadata = encode_layer(v)
                save_file(tensors, str(dest / layer_file_name(i, p)), metadata=metadata)
            if Precision.INT4 in variants and not groups:
                groups = {n: r.group_size for n, r in variants[Precision.INT4].linears.items()}
    finally:
        torch.set_num_threads(threads)
    manifest = StoreManifest(model=spec.model_name, num_layers=model.config.num_layers, dtype=spec.full.value,
                             precisions=(spec.full.value, *(p.value for p in spec.ladder)),
                             layer_bytes=tuple(layer_bytes), int4_method=plan.method, int4_group_sizes=groups,
                             calibration=plan.calibration, fingerprint=fp,
                             build_seconds=round(time.perf_counter() - t0, 3))
    (dest / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def ensure_host_store(model: Transformer, spec: StoreSpec, cache_dir: Path, tokenizer=None,
                      calibration_ids: Sequence[Sequence[int]] | None = None) -> HostStore:
    """Open the store for `spec`, building it first if it does not exist yet (locked, atomic)."""
    plan = plan_build(spec, tokenizer, calibration_ids)
    fp = fingerprint(spec, plan)
    root = store_root(cache_dir, spec.model_name)
    final = root / fp
    if (final / MANIFEST).is_file():
        return HostStore(final)
    with exclusive_build(root, f"{fp}.lock", f"the host store {final}"):
        if not (final / MANIFEST).is_file():  # another replica may have finished meanwhile
            for stale in root.glob(f".tmp-{fp}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)  # a folder without manifest is a crashed build
            tmp = root / f".tmp-{fp}-{os.getpid()}"
            try:
                build_store(model, spec, tmp, plan, fp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.rename(tmp, final)
    return HostStore(final)
