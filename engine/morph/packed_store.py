"""PackedStore: every variant of every layer exactly as this process's kernels hold it in memory, on disk
beside the host store, so that a swap or a restore maps it: no packing, no copy, no fresh zeroed pages,
and no transient second copy.

    <host store>/packed/<digest>/layer_007.bf16.blobs   the full precision's groups (q/k/v, o, gate/up,
                                                        down) in oneDNN's packed layout: per group the
                                                        bytes, oneDNN's serialized descriptor, the bias
                                 layer_007.int4.blobs   the host store's INT4 records in this process's
                                 layer_007.int8.blobs   kernel layout, a fused group's members back to back
                                 (+ the norms and biases; format: engine/morph/blob_file.py)

SmolLM2, one thread (before): re-packing a restored layer from its plain rows was ~2/3 of a 15 ms
restore and copying most of the rest; an INT4 swap-down copied the layer twice (once from the map,
once more to fuse q/k/v and gate/up) into freshly faulted pages. A layer's weights are now views of
its file's private map (page cache, mapped in one call): resident while the layer holds that variant
(the ledger counts them as the layer's bytes), unmapped when it changes again.

Written once, by the first engine that needs it (at start-up, locked, atomic), from the host store's own
files: the bytes the old path produced at each swap. The digest covers this process's layouts (oneDNN's
packing probed here, `packed_layout`; the INT4 kernel's, int4_kernel.cpu_layout), so a process that
would lay bytes out differently builds its own folder. The full precision is stored only where the model
runs packed layers and the compiled op (engine/kernels/mkldnn_blob.cpp) can wrap bytes back; elsewhere
restores read the host store as before.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from engine.cache_lock import exclusive_build
from engine.errors import ModelLoadError
from engine.kernels import mkldnn_blob_reason
from engine.layers.linear import Linear
from engine.layers.packed import PackedGroup, PackedLinear, packing_available
from engine.model import FUSED_GROUPS, NORM_NAMES
from engine.morph.host_store import HostStore, decode_layer
from engine.morph.blob_file import MappedBlobs, write_blobs
from engine.precision import Precision, full_precision_for, torch_dtype
from engine.quant.awq import QuantizedLayer
from engine.quant.int4_kernel import cpu_layout

logger = logging.getLogger(__name__)
PACK_GROUPS = (*FUSED_GROUPS, ("o_proj",), ("down_proj",))  # what DecoderLayer packs when `pack` is set
DONE = "complete"
PACKED_VERSION = 2  # bump when the files' layout changes (2: INT4 scales stored fused along the columns)


@functools.cache
def packed_layout(dtype: torch.dtype) -> str | None:
    """This process's oneDNN packing key for `dtype` weights (a probe packed and hashed: its bytes and
    descriptor change when oneDNN's layout does), or None when packed layers cannot be stored and wrapped back."""
    if mkldnn_blob_reason() is not None:
        return None
    probe = ((torch.arange(96 * 128).reshape(96, 128) % 251) - 125).to(dtype) / 64
    blob, md = PackedGroup(probe, None).to_blob()
    digest = hashlib.sha256(blob.numpy().tobytes() + md.numpy().tobytes()).hexdigest()[:12]
    return f"mkldnn:torch-{torch.__version__}:{torch.backends.cpu.get_cpu_capability()}:{digest}"


def layer_file(folder: Path, layer: int, precision: Precision) -> Path:
    return folder / f"layer_{layer:03d}.{precision.value}.blobs"


class PackedStore:
    """A built folder; `read_full` -> a layer's linears and norms, `read_quantized` -> its record."""

    def __init__(self, folder: Path, layout: str):
        self.folder, self.layout = Path(folder), layout
        self.full = Precision((self.folder / DONE).read_text(encoding="utf-8").split("\n")[0])

    def has(self, layer: int, precision: Precision) -> bool:
        return layer_file(self.folder, layer, precision).is_file()

    def _open(self, layer: int, precision: Precision) -> MappedBlobs:
        f = MappedBlobs(layer_file(self.folder, layer, precision))
        if f.metadata.get("layout") != self.layout:
            raise ValueError(f"laid out as {f.metadata.get('layout')!r}, this process uses {self.layout!r}")
        return f

    def read_full(self, layer: int) -> tuple[dict[str, Linear], dict[str, torch.Tensor]]:
        """The layer's packed groups and norms, as views of the file's map."""
        try:
            f = self._open(layer, self.full)
            groups, dtype = json.loads(f.metadata["groups"]), torch_dtype(Precision(f.metadata["dtype"]))
            linears: dict[str, Linear] = {}
            for i, (names, sizes, k) in enumerate(groups):
                bias = f.tensor(f"g{i}.bias") if f"g{i}.bias" in f.names else None
                group = PackedGroup.from_blob(f.tensor(f"g{i}.blob"), f.tensor(f"g{i}.md"), bias, sum(sizes), k, dtype)
                row = 0
                for name, n in zip(names, sizes):
                    linears[name] = PackedLinear(group, row, n)
                    row += n
            return linears, {n: f.tensor(f"{n}.weight") for n in NORM_NAMES}
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise self._error(layer, self.full.value, e) from e

    def read_quantized(self, layer: int, precision: Precision) -> QuantizedLayer:
        """The layer's record at `precision`, its tensors views of the file's map."""
        try:
            f = self._open(layer, precision)
            return decode_layer(_column_views({n: f.tensor(n) for n in f.names}, f.metadata), f.metadata, precision)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            raise self._error(layer, precision.value, e) from e

    def _error(self, layer: int, precision: str, e: Exception) -> ModelLoadError:
        return ModelLoadError(f"cannot read layer {layer} at {precision} from {self.folder} ({e}); delete the "
                              f"folder and restart to rebuild it")


def store_layout(store: HostStore) -> str:
    """The key of the layouts this process stores for `store` (format version, oneDNN's, INT4's)."""
    dtype = torch_dtype(Precision(store.manifest.dtype))
    packed = packed_layout(dtype) if packing_available(dtype, "cpu") else None
    return f"v{PACKED_VERSION}|{packed or 'plain'}|{cpu_layout()}"


def ensure_packed_store(store: HostStore) -> PackedStore | None:
    """The store's layers in this process's in-memory form, built first if missing (locked, atomic);
    None, said in the log, when it cannot be written (a read-only cache): swaps then read the host store."""
    layout = store_layout(store)
    digest = hashlib.sha256(layout.encode()).hexdigest()[:16]
    root = store.path / "packed"
    folder = root / digest
    try:
        with exclusive_build(root, f"{digest}.lock", f"the packed layers {folder}"):
            if not (folder / DONE).is_file():
                _build(store, layout, folder)
        return PackedStore(folder, layout)
    except (ModelLoadError, OSError) as e:
        logger.warning("no packed layers for %s (%s): swaps and restores copy from the host store", store.path, e)
        return None


def _build(store: HostStore, layout: str, folder: Path) -> None:
    t0 = time.perf_counter()
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    full, *low = store.precisions
    for layer in range(store.num_layers):
        if "|plain|" not in layout:
            stored = store.read(layer, full)
            runs, metadata = _encode_full(stored.linears, stored.biases, stored.norms)
            if runs is None:
                logger.warning("layer %d cannot be stored packed (%s); its restores pack", layer, metadata["why"])
            else:
                write_blobs(layer_file(tmp, layer, full), runs, {**metadata, "layout": layout})
        for p in low:
            runs, metadata = _encode_quantized(store.read(layer, p, "cpu"))
            write_blobs(layer_file(tmp, layer, p), runs, {**metadata, "layout": layout})
    (tmp / DONE).write_text(f"{full.value}\n{layout}")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    logger.info("laid out %d layers for %s in %.1fs", store.num_layers, layout, time.perf_counter() - t0)


Runs = list[list[tuple[str, torch.Tensor]]]


def _encode_full(weights: dict[str, torch.Tensor], biases: dict[str, torch.Tensor], norms: dict[str, torch.Tensor]
                 ) -> tuple[Runs | None, dict[str, str]]:
    """A layer's packed groups as runs + metadata, or (None, {"why": ...})."""
    runs: Runs = [[(f"{n}.weight", norms[n])] for n in NORM_NAMES]
    groups, dtypes = [], {w.dtype for w in weights.values()}
    if len(dtypes) != 1:
        return None, {"why": f"mixed dtypes {sorted(map(str, dtypes))}"}
    for i, names in enumerate(PACK_GROUPS):
        if len({weights[n].shape[1] for n in names}) != 1 or len({n in biases for n in names}) != 1:
            return None, {"why": f"{names} cannot be fused"}
        weight = torch.cat([weights[n] for n in names])
        bias = torch.cat([biases[n] for n in names]) if names[0] in biases else None
        blob, md = PackedGroup(weight, bias).to_blob()
        runs += [[(f"g{i}.blob", blob)], [(f"g{i}.md", md)]] + ([[(f"g{i}.bias", bias)]] if bias is not None else [])
        groups.append([list(names), [int(weights[n].shape[0]) for n in names], int(weight.shape[1])])
    return runs, {"groups": json.dumps(groups), "dtype": full_precision_for(dtypes.pop()).value}


def _encode_quantized(stored: QuantizedLayer) -> tuple[Runs, dict[str, str]]:
    """A quantized layer's records as runs (each fused group's tensors of one kind back to back) + metadata.
    An INT4 group's scales_and_zeros ([in/G, out, 2]) fuse along the columns, so they are stored as the
    fused tensor itself (its members are column views of it, see read_quantized): a back-to-back run
    cannot make that layout, and a second fused copy would be bytes the ledger does not count."""
    tensors = {f"{n}.weight": t for n, t in stored.norms.items()}
    tensors.update({f"{n}.bias": t for n, t in stored.biases.items()})
    metadata = {"format": stored.precision.value}
    for n, record in stored.linears.items():
        t, m = record.to_tensors(f"{n}.")
        tensors.update(t)
        metadata.update(m)
    column_groups = []
    for group in FUSED_GROUPS:
        sz = [tensors.get(f"{m}.scales_and_zeros") for m in group]
        if all(t is not None and t.dim() == 3 for t in sz) and len({(t.dtype, t.shape[0]) for t in sz}) == 1:
            tensors[_fused_sz(group)] = torch.cat(sz, dim=1)
            for m in group:
                del tensors[f"{m}.scales_and_zeros"]
            column_groups.append([list(group), [int(t.shape[1]) for t in sz]])
    metadata["column_fused_scales"] = json.dumps(column_groups)
    runs: Runs = []
    for group in FUSED_GROUPS:
        for kind in [k.partition(".")[2] for k in tensors if k.partition(".")[0] == group[0]]:
            members = [(f"{m}.{kind}", tensors.get(f"{m}.{kind}")) for m in group]
            if all(t is not None for _, t in members) and len({(t.dtype, t.shape[1:]) for _, t in members}) == 1:
                runs.append(members)
    placed = {name for run in runs for name, _ in run}
    return runs + [[(n, t)] for n, t in tensors.items() if n not in placed], metadata


def _fused_sz(group: tuple[str, ...]) -> str:
    return f"{'+'.join(group)}.scales_and_zeros"


def _column_views(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each member's scales_and_zeros as its column slice of the group's stored fused tensor."""
    for group, sizes in json.loads(metadata.get("column_fused_scales", "[]")):
        fused, col = tensors.pop(_fused_sz(tuple(group))), 0
        for m, n in zip(group, sizes):
            tensors[f"{m}.scales_and_zeros"] = fused[:, col:col + n]
            col += n
    return tensors
