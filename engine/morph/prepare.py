"""Build a model's host store (and, with --profile, its layer-importance profile), once.

    python -m engine.morph.prepare [--model default] [--dtype bf16] [--awq-checkpoint DIR] [--profile]

The engine calls `ensure_host_store` on start-up, so running this by hand is only a way to pay the
build before the first start. Building is atomic (written into a temp folder, renamed into place)
and locked (two replicas starting together build once; the second waits and reuses).

INT4 comes from, in order: an AWQ / compressed-tensors checkpoint when configured; the project's own
AWQ calibrated on a few sequences of the FIRST half of WikiText-2 (the second half is left for
perplexity) when the model has a tokenizer; plain RTN otherwise. The manifest records which.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.batch import ScheduledChunk
from engine.cache_lock import exclusive_build
from engine.errors import ModelLoadError
from engine.layers.linear import DenseLinear, tensor_nbytes
from engine.model import Transformer
from engine.model_runner import ModelRunner
from engine.morph.host_store import (MANIFEST, STORE_VERSION, HostStore, StoredLayer, StoreManifest, encode_layer,
                                     layer_file_name, store_root)
from engine.precision import Precision
from engine.quant import quantized_nbytes
from engine.quant.awq import LayerCalibration, LayerWeights, awq_quantize_layer, quantize_layer_rtn
from engine.quant.checkpoints import load_int4_layer, open_int4_checkpoint
from engine.quant.int4_kernel import cpu_layout

# WikiText-2 lies in the shared data folder beside the repository (../shared/text); the variable moves it.
CALIBRATION_TEXT = Path(os.environ.get(
    "MORPHSERVE_CALIBRATION_TEXT",
    Path(__file__).resolve().parents[3] / "shared" / "text" / "wikitext-2-valid.txt"))


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """Everything a store's bytes depend on; its hash names the store folder."""
    model_name: str
    hf_dir: Path
    full: Precision
    ladder: tuple[Precision, ...]  # the lower rungs, e.g. (INT8, INT4)
    int4_group_size: int = 128
    int4_checkpoint: Path | None = None
    calibration_text: Path | None = CALIBRATION_TEXT  # None or missing -> RTN
    # Small on purpose: the default model builds on first start and in CI, on CPU. 256 tokens and 6
    # alphas (0 = RTN included, so AWQ never does worse than RTN on them) keep it to about a minute.
    calibration_seqs: int = 4
    calibration_len: int = 64
    awq_grid: int = 6


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


def fingerprint(spec: StoreSpec, method: str, calibration_ids: Sequence[Sequence[int]] | None) -> str:
    key = {"version": STORE_VERSION, "model": _files_identity(spec.hf_dir), "full": spec.full.value,
           "ladder": [p.value for p in spec.ladder], "group": spec.int4_group_size, "method": method,
           "checkpoint": [str(spec.int4_checkpoint), _files_identity(spec.int4_checkpoint)],
           "calibration": [list(map(list, calibration_ids or [])), spec.awq_grid],  # ids cover text+lengths
           "int4_cpu_layout": cpu_layout() if Precision.INT4 in spec.ladder else None}  # the stored kernel bytes
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def calibration_token_ids(tokenizer, text_path: Path, num_seqs: int, seq_len: int) -> list[list[int]]:
    """`num_seqs` windows of `seq_len` tokens, evenly spaced over the first half of the text."""
    text = text_path.read_text(encoding="utf-8")
    half = text[: len(text) // 2]
    window = seq_len * 8  # characters: comfortably more than seq_len tokens of English
    starts = [int(i * (len(half) - window) / max(1, num_seqs - 1)) for i in range(num_seqs)]
    seqs = [tokenizer.encode(half[s:s + window])[:seq_len] for s in starts]
    return [s for s in seqs if len(s) >= 8]


def collect_calibration(model: Transformer, sequences: Sequence[Sequence[int]]) -> list[LayerCalibration]:
    """Run the full-precision model over each sequence and record, per layer, its input, its
    attention output (o_proj's input) and its residual before post_attention_layernorm."""
    captured: list[dict[str, list[torch.Tensor]]] = [{"hidden": [], "attn_out": [], "residual": []} for _ in model.layers]
    hooks = []
    for layer, store in zip(model.layers, captured):
        for module, key in ((layer, "hidden"), (layer.o_proj, "attn_out"), (layer.post_attention_layernorm, "residual")):
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, store=store, key=key: store[key].append(args[0].detach().float().cpu())))
    cfg, device = model.config, model.embed_weight.device
    runner = ModelRunner(model, None, device)
    try:
        with torch.inference_mode():
            for seq in sequences:
                n = len(seq)
                inputs = runner.prepare([ScheduledChunk("calibration", tuple(seq), 0, (0,), True)], block_size=n)
                kv = [(torch.empty(1, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=device),
                       torch.empty(1, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype, device=device))
                      for _ in model.layers]
                model(inputs.input_ids, inputs.positions, inputs.meta, kv)
    finally:
        for h in hooks:
            h.remove()
    return [LayerCalibration(**{k: torch.cat(v) for k, v in store.items()}) for store in captured]


def full_layer(model: Transformer, i: int) -> LayerWeights:
    """Layer i's tensors exactly as the model holds them (it must still be at full precision)."""
    layer = model.layers[i]
    linears = layer.get_linears()
    if not all(isinstance(lin, DenseLinear) for lin in linears.values()):
        raise RuntimeError(f"layer {i} is not at full precision; build the host store before any swap")
    return LayerWeights(linears={n: lin.weight for n, lin in linears.items()}, norms=layer.get_norm_weights(),
                        biases={n: lin.bias for n, lin in linears.items() if lin.bias is not None})


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
        full = full_layer(model, i)
        out: dict[Precision, StoredLayer] = {spec.full: full}
        cpu_full = LayerWeights({n: t.cpu() for n, t in full.linears.items()}, {n: t.cpu() for n, t in full.norms.items()},
                                {n: t.cpu() for n, t in full.biases.items()})
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


def build_store(model: Transformer, spec: StoreSpec, dest: Path, method: str,
                calibration_ids: Sequence[Sequence[int]] | None, fp: str) -> StoreManifest:
    """Write every layer in every precision into `dest` (a fresh folder), manifest last."""
    t0 = time.perf_counter()
    dest.mkdir(parents=True)
    # Small matrices do not amortise thread synchronisation: on the shared 2-core CI box SmolLM2's
    # build took 537 s with 2 threads and 42 s with 1. Big models (hidden >= 2048) keep more threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, model.config.hidden_size // 1024)))
    try:
        return _build_store(model, spec, dest, method, calibration_ids, fp, t0)
    finally:
        torch.set_num_threads(threads)


def _build_store(model: Transformer, spec: StoreSpec, dest: Path, method: str,
                 calibration_ids: Sequence[Sequence[int]] | None, fp: str, t0: float) -> StoreManifest:
    calib = collect_calibration(model, calibration_ids) if method == "awq" else None
    ckpt = open_int4_checkpoint(spec.int4_checkpoint) if method.startswith("checkpoint") else None
    layer_bytes, groups = [], {}
    for i, variants in _variants(model, spec, method, calib, ckpt):
        layer_bytes.append({p.value: resident_bytes(v) for p, v in variants.items()})
        for p, v in variants.items():
            tensors, metadata = encode_layer(v)
            save_file(tensors, str(dest / layer_file_name(i, p)), metadata=metadata)
        if Precision.INT4 in variants and not groups:
            groups = {n: r.group_size for n, r in variants[Precision.INT4].linears.items()}
    calibration = ({"text": str(spec.calibration_text), "sequences": len(calibration_ids),
                    "tokens": sum(map(len, calibration_ids)), "grid": spec.awq_grid} if method == "awq"
                   else {"reason": _rtn_reason(spec, method)})
    manifest = StoreManifest(model=spec.model_name, num_layers=model.config.num_layers, dtype=spec.full.value,
                             precisions=(spec.full.value, *(p.value for p in spec.ladder)),
                             layer_bytes=tuple(layer_bytes), int4_method=method, int4_group_sizes=groups,
                             calibration=calibration, fingerprint=fp, build_seconds=round(time.perf_counter() - t0, 3))
    (dest / MANIFEST).write_text(manifest.to_json(), encoding="utf-8")
    return manifest


def _rtn_reason(spec: StoreSpec, method: str) -> str:
    if method.startswith("checkpoint"):
        return f"INT4 from checkpoint {spec.int4_checkpoint}"
    if Precision.INT4 not in spec.ladder:
        return "no INT4 rung in the ladder"
    return "no tokenizer or calibration text: INT4 by round-to-nearest"


def choose_method(spec: StoreSpec, tokenizer, calibration_ids) -> tuple[str, list[list[int]] | None]:
    if spec.int4_checkpoint is not None and Precision.INT4 in spec.ladder:
        return f"checkpoint:{spec.int4_checkpoint}", None
    if Precision.INT4 not in spec.ladder:
        return "rtn", None
    if calibration_ids is None and tokenizer is not None and spec.calibration_text is not None \
            and spec.calibration_text.is_file():
        calibration_ids = calibration_token_ids(tokenizer, spec.calibration_text, spec.calibration_seqs,
                                                spec.calibration_len)
    if calibration_ids:
        return "awq", [list(s) for s in calibration_ids]
    return "rtn", None


def ensure_host_store(model: Transformer, spec: StoreSpec, cache_dir: Path, tokenizer=None,
                      calibration_ids: Sequence[Sequence[int]] | None = None) -> HostStore:
    """Open the store for `spec`, building it first if it does not exist yet (locked, atomic)."""
    method, ids = choose_method(spec, tokenizer, calibration_ids)
    fp = fingerprint(spec, method, ids)
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
                build_store(model, spec, tmp, method, ids, fp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.rename(tmp, final)
    return HostStore(final)


def store_spec_for(config, model_name: str, hf_dir: Path) -> StoreSpec:
    """The spec an EngineConfig implies (the engine and this CLI must agree, or they build twice)."""
    from engine.precision import full_precision_for
    ckpt = getattr(config, "int4_checkpoint", None)
    return StoreSpec(model_name=model_name, hf_dir=Path(hf_dir), full=full_precision_for(config.torch_dtype),
                     ladder=config.ladder, int4_group_size=config.int4_group_size,
                     int4_checkpoint=Path(ckpt).expanduser().resolve() if ckpt else None)


def prepared_profile_path(cache_dir: Path, model_name: str) -> Path:
    """Where `--profile` writes the layer-importance profile (the engine prefers it to the committed one)."""
    return Path(cache_dir) / "models" / model_name / f"{model_name}.lis.json"


def main(argv: Sequence[str] | None = None) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import _load_tokenizer
    from engine.loader import load_config, load_weights, resolve_model
    from engine.model import build_model

    ap = argparse.ArgumentParser(prog="python -m engine.morph.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--awq-checkpoint", default=None, help="AutoAWQ / compressed-tensors INT4 folder")
    ap.add_argument("--ladder", default="int8,int4")
    ap.add_argument("--int4-group-size", type=int, default=128)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--profile", action="store_true", help="also compute the layer-importance profile")
    args = ap.parse_args(argv)
    config = EngineConfig(model=args.model, dtype=args.dtype, int4_checkpoint=args.awq_checkpoint,
                          morph_ladder=tuple(args.ladder.split(",")), int4_group_size=args.int4_group_size,
                          cache_dir=args.cache_dir)
    files = resolve_model(config.model, config.cache_path)
    model = build_model(load_config(files.hf_dir), load_weights(files.hf_dir, config.torch_dtype),
                        config.torch_dtype, "cpu")
    t0 = time.perf_counter()
    store = ensure_host_store(model, store_spec_for(config, files.name, files.hf_dir), config.cache_path,
                              _load_tokenizer(files.hf_dir))
    m = store.manifest
    print(f"host store {store.path}: {m.num_layers} layers x {list(m.precisions)}, int4 by {m.int4_method}, "
          f"built in {m.build_seconds:.1f}s (this call {time.perf_counter() - t0:.1f}s)")
    if args.profile:
        return _run_profiler(config, files, prepared_profile_path(config.cache_path, files.name))
    return 0


def _run_profiler(config, files, out: Path) -> int:
    from engine.morph import profiler  # imported here: profiler imports this module

    profiler.main(["--model", str(config.model), "--group-size", str(config.int4_group_size), "--out", str(out)])
    print(f"profile written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
