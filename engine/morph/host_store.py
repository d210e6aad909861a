"""HostStore: every decoder layer in every precision of the ladder, on disk, memory-mapped.

Built once per model (engine/morph/prepare.py) and reused by every replica:

    <cache_dir>/models/<model name>/store/<fingerprint>/
        layer_000.bf16.safetensors   the layer's 7 linears, biases and 2 norms, exactly at the model dtype
        layer_000.int8.safetensors   RTN INT8 records + the biases and norms to use with them
        layer_000.int4.safetensors   AWQ (or RTN, or checkpoint) INT4 records + biases + norms (AWQ folds
        ...                          scales into the norms, so each variant carries its own), and each
                                     INT4 linear again as the CPU kernel holds it ("<linear>.kernel.*")
        manifest.json                written last: resident bytes per layer per precision, methods, dtype

The fingerprint covers everything the bytes depend on (weights' identity, dtype, ladder, group size,
INT4 source), so a changed setting builds a new store instead of reusing a wrong one. Reads go through
a private memory map (morph/mapped_file.py, views without a copy); `read` copies what it returns
once, so the caller's modules
own their memory and dropping them really frees it.

Why the INT4 file holds the CPU kernel's layout too: re-packing canonical codes for the CPU kernel
was most of an INT4 swap-down (SmolLM2: ~19 ms of packing per layer against a few ms of copying). The
layout is keyed (int4_kernel.cpu_layout: torch version, ISA, a probe of the packing itself) and the
key is part of the store's fingerprint; `read(..., device)` still falls back to the canonical record
(packed at load) for another key, for CUDA, and for shapes the kernel cannot take.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.model import FUSED_GROUPS, LINEAR_NAMES, NORM_NAMES
from engine.morph.mapped_file import MappedSafetensors
from engine.morph.page_buffer import carve, typed
from engine.precision import Precision
from engine.quant import Int4Weight, from_tensors
from engine.quant.awq import LayerWeights, QuantizedLayer
from engine.quant.int4_kernel import cpu_layout, layout_backend, pack_int4

STORE_VERSION = 2  # bump when the file layout changes: old stores then get a new fingerprint (2: INT4 kernel layout)
MANIFEST = "manifest.json"
KERNEL_PREFIX = "kernel."  # "<linear>.kernel.packed" / ".scales_and_zeros" (+ metadata ".layout", ".group_size")
PREPARE_HINT = "re-run `python -m engine.morph.prepare --model <model>` (or delete the store folder and restart)"

StoredLayer = LayerWeights | QuantizedLayer


def store_root(cache_dir: Path, model_name: str) -> Path:
    return Path(cache_dir) / "models" / model_name / "store"


def layer_file_name(layer: int, precision: Precision) -> str:
    return f"layer_{layer:03d}.{precision.value}.safetensors"


@dataclasses.dataclass(frozen=True)
class StoreManifest:
    model: str
    num_layers: int
    dtype: str  # the full precision, e.g. "bf16"
    precisions: tuple[str, ...]  # the ladder, full first: ("bf16", "int8", "int4")
    layer_bytes: tuple[dict[str, int], ...]  # [layer][precision] -> resident bytes of its 7 linears
    int4_method: str  # "awq" | "rtn" | "checkpoint:<dir>"
    int4_group_sizes: dict[str, int]  # linear name -> group size used
    calibration: dict[str, Any]  # what AWQ was calibrated on (or why it was not)
    fingerprint: str
    build_seconds: float
    version: int = STORE_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "StoreManifest":
        data = json.loads(text)
        data["precisions"] = tuple(data["precisions"])
        data["layer_bytes"] = tuple(data["layer_bytes"])
        return cls(**data)


class HostStore:
    """A built store, opened read-only. `read(layer, precision)` -> the layer's tensors on CPU."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.manifest = StoreManifest.from_json((self.path / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ModelLoadError(f"host store {self.path} has no readable {MANIFEST} ({e}); {PREPARE_HINT}") from e
        if self.manifest.version != STORE_VERSION:
            raise ModelLoadError(f"host store {self.path} has layout version {self.manifest.version}, this engine "
                                 f"reads {STORE_VERSION}; {PREPARE_HINT}")
        self.precisions = tuple(Precision(p) for p in self.manifest.precisions)
        self.check_integrity()

    @property
    def num_layers(self) -> int:
        return self.manifest.num_layers

    def layer_file(self, layer: int, precision: Precision) -> Path:
        return self.path / layer_file_name(layer, precision)

    def layer_bytes(self, layer: int, precision: Precision) -> int:
        """Resident bytes of the layer's linears at `precision` (what the ledger will count)."""
        self._check_known(layer, precision)
        return self.manifest.layer_bytes[layer][precision.value]

    def check_integrity(self) -> None:
        """Every variant file the manifest promises is there: a missing one fails at start-up."""
        if len(self.manifest.layer_bytes) != self.num_layers:
            raise ModelLoadError(f"host store {self.path}: manifest lists {len(self.manifest.layer_bytes)} layers, "
                                 f"expected {self.num_layers}; {PREPARE_HINT}")
        for layer in range(self.num_layers):
            for p in self.precisions:
                if not self.layer_file(layer, p).is_file():
                    raise ModelLoadError(f"host store {self.path} lacks layer {layer} at {p.value} "
                                         f"({layer_file_name(layer, p)}); {PREPARE_HINT}")

    def read(self, layer: int, precision: Precision, device: torch.device | str | None = None) -> StoredLayer:
        """The layer at `precision`: LayerWeights for the full precision (bit-exact copies of the
        original tensors), QuantizedLayer for int8/int4. Fresh tensors, not views of the map.

        Without `device`: canonical records on CPU (what quality tools and tests compare). With it:
        what building the layer's linears on `device` needs, copied once from the map straight onto
        it; INT4 linears come as PackedInt4Weight when the store holds this process's layout."""
        self._check_known(layer, precision)
        target = torch.device("cpu" if device is None else device)
        layout = cpu_layout() if device is not None and target.type == "cpu" and precision == Precision.INT4 else None
        path = self.layer_file(layer, precision)
        try:
            with MappedSafetensors(path) as f:
                metadata = f.metadata
                names = _wanted(f.names, metadata, layout)
                tensors = _copy_out(f, names, target, fuse=device is not None)
        except FileNotFoundError:
            raise ModelLoadError(f"host store {self.path} lacks layer {layer} at {precision.value} "
                                 f"({path.name}); {PREPARE_HINT}") from None
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read layer {layer} at {precision.value} from {path} ({e}); {PREPARE_HINT}") from e
        try:
            return decode_layer(tensors, metadata, precision)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{path} does not hold layer {layer} at {precision.value} ({e}); {PREPARE_HINT}") from e

    def _check_known(self, layer: int, precision: Precision) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        if precision not in self.precisions:
            raise ValueError(f"the host store holds {[p.value for p in self.precisions]}, not {precision.value}")


def encode_layer(stored: StoredLayer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A layer as flat safetensors tensors + metadata (inverse of `decode_layer`)."""
    tensors = {f"{n}.weight": t for n, t in stored.norms.items()}
    tensors.update({f"{n}.bias": t for n, t in stored.biases.items()})
    metadata: dict[str, str] = {}
    if isinstance(stored, LayerWeights):
        tensors.update({f"{n}.weight": t for n, t in stored.linears.items()})
        metadata["format"] = "full"
    else:
        metadata["format"] = stored.precision.value
        for n, record in stored.linears.items():
            t, m = record.to_tensors(f"{n}.")
            tensors.update(t)
            metadata.update(m)
            if isinstance(record, Int4Weight):
                t, m = _cpu_kernel_tensors(record, f"{n}.{KERNEL_PREFIX}")
                tensors.update(t)
                metadata.update(m)
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata


def _cpu_kernel_tensors(record: Int4Weight, prefix: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The record as the CPU kernel holds it (nothing for shapes the kernel cannot take)."""
    on_cpu = Int4Weight(record.qweight.cpu(), record.scales.cpu(), record.zeros.cpu(), record.group_size)
    packed = pack_int4(on_cpu)
    return packed.to_tensors(prefix) if layout_backend(packed.layout) == "cpu" else ({}, {})


def _copy_out(f: "MappedSafetensors", names: list[str], target: torch.device, fuse: bool) -> dict[str, torch.Tensor]:
    """One copy of each tensor from the map onto `target`. On CPU the whole layer lands in one weight
    buffer (page_buffer.py: huge pages, unmapped when the layer is dropped). With `fuse`, the tensors of
    each group the model runs as one call (q/k/v, gate/up: weights, INT8 codes, INT4 packed bytes) are
    adjacent rows of that buffer, so the layer fuses them without concatenating: a swap allocates its
    weights once, in their final form."""
    runs = _runs(f, names, fuse)
    out: dict[str, torch.Tensor] = {}
    if target.type != "cpu":
        for run in runs:
            for name in run:
                out[name] = f.tensor(name).to(target, copy=True)
        return out
    # INT4 scales fuse along the columns (quant/fused.py concatenates them): kept apart, so the
    # members' copies are freed once the fused one exists (in the buffer they would stay, uncounted).
    for run in [r for r in runs if r[0].endswith("scales_and_zeros")]:
        runs.remove(run)
        for name in run:
            out[name] = f.tensor(name).clone()
    raws = carve([sum(f.tensor(n).nbytes for n in run) for run in runs])
    for run, raw in zip(runs, raws):
        offset = 0
        for name in run:
            view = f.tensor(name)
            out[name] = typed(raw[offset:offset + view.nbytes], view.dtype, view.shape)
            out[name].copy_(view)
            offset += view.nbytes
    return out


def _runs(f: "MappedSafetensors", names: list[str], fuse: bool) -> list[list[str]]:
    """`names` in runs to lay out back to back: each fused group's tensors of one kind together, in the
    group's order (when their dtypes and row shapes agree), every other tensor alone."""
    runs, placed = [], set()
    for group in (FUSED_GROUPS if fuse else ()):
        for name in names:
            linear, _, kind = name.partition(".")
            if linear != group[0]:
                continue
            run = [f"{member}.{kind}" for member in group]
            views = [f.tensor(n) for n in run if n in names]
            if len(views) == len(run) and len({(v.dtype, tuple(v.shape[1:])) for v in views}) == 1:
                runs.append(run)
                placed.update(run)
    return runs + [[name] for name in names if name not in placed]


def _wanted(names, metadata: dict[str, str], layout: str | None) -> list[str]:
    """The tensors to copy: each INT4 linear once, packed when it was stored for `layout`, else canonical."""
    packed = {n for n in LINEAR_NAMES if layout is not None and metadata.get(f"{n}.{KERNEL_PREFIX}layout") == layout}

    def keep(name: str) -> bool:
        linear, _, rest = name.partition(".")
        if rest.startswith(KERNEL_PREFIX):
            return linear in packed
        return linear not in packed or rest not in ("qweight", "scales", "zeros")
    return [name for name in names if keep(name)]


def decode_layer(tensors: dict[str, torch.Tensor], metadata: dict[str, str], precision: Precision) -> StoredLayer:
    norms = {n: tensors[f"{n}.weight"] for n in NORM_NAMES}
    biases = {n: tensors[f"{n}.bias"] for n in LINEAR_NAMES if f"{n}.bias" in tensors}
    if precision.is_full:
        if metadata.get("format") != "full":
            raise ValueError(f"stored as {metadata.get('format')!r}, not full precision")
        return LayerWeights(linears={n: tensors[f"{n}.weight"] for n in LINEAR_NAMES}, norms=norms, biases=biases)
    if metadata.get("format") != precision.value:
        raise ValueError(f"stored as {metadata.get('format')!r}, not {precision.value}")
    prefixes = {n: f"{n}.{KERNEL_PREFIX}" if f"{n}.{KERNEL_PREFIX}packed" in tensors else f"{n}." for n in LINEAR_NAMES}
    layer = QuantizedLayer(precision, {n: from_tensors(tensors, metadata, p) for n, p in prefixes.items()}, norms, biases)
    layer.check_integrity()
    return layer
