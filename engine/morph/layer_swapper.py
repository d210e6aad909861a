"""LayerSwapper: move one decoder layer to another precision of the ladder, between two steps.

    down (fewer bytes)                          up (more bytes, e.g. restore)
    1. load the variant (maybe prefetched)      1. KVResizer shrinks by the bytes the layer needs back
    2. switch: layer.set_weights (atomic)          (migrating live blocks; "waiting" if they do not fit,
    3. drop the old copy                            and then nothing has changed)
    4. credit the ledger                        2. claim the bytes in the ledger
    5. KVResizer grows by what the ledger frees 3. load, switch, drop the old copy

Going up claims memory before loading, so weights + kv + reserve <= budget holds at every point the
ledger can observe. A down move loads first and frees after, so for a moment both copies exist: the
smaller one is the new one, and it fits in the activation reserve (a layer at INT8 is a fraction of
what one step's activations take; no step runs meanwhile). Prefetch (a worker thread) is used for down
moves only, and a prefetched copy is claimed in the ledger (staged) before it is loaded, so an up move
never holds a copy that the ledger has not paid for.

What a load costs: one copy from the host store's map into the layer's final memory, one buffer per
layer from the OS (morph/page_buffer.py). A full-precision layer that the model runs pre-packed comes
from the PackedStore (morph/packed_store.py) already in oneDNN's layout; without one it is packed at the
switch (its plain rows are then a transient copy on the heap, inside the activation reserve). Dropping
page-buffered weights unmaps them; only weights that lived on the heap (the loader's, or packed at a
switch) need malloc_trim for the resident set to fall.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

import torch

from engine.errors import ModelLoadError
from engine.layers.linear import DenseLinear, Linear
from engine.ledger import MemoryLedger
from engine.model import Transformer
from engine.morph.host_store import HostStore, StoredLayer
from engine.morph.kv_resizer import KVResizer
from engine.morph.packed_store import PackedStore
from engine.precision import Precision
from engine.quant.awq import LayerWeights

logger = logging.getLogger(__name__)
_MAX_PREFETCHED = 4  # loaded-but-unused variants held at once (each is a low-precision layer)


@dataclasses.dataclass(frozen=True)
class SwapResult:
    layer: int
    before: Precision
    after: Precision  # the layer's precision once this returns (== before unless status is "done")
    status: Literal["done", "waiting", "noop", "rejected"]
    weight_bytes_delta: int = 0  # negative when weights were freed
    kv_blocks_delta: int = 0  # positive when KV grew
    blocks_migrated: int = 0
    swap_seconds: float = 0.0  # load + switch + free
    resize_seconds: float = 0.0
    message: str = ""


def layer_precision(model: Transformer, layer: int) -> Precision:
    return model.layers[layer].q_proj.precision  # not get_linears(): 7 module lookups per layer per check


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    # Loaded once: dlopen-ing libc on every swap took ~8 ms, as much as copying an INT4 layer.
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to trim with
        return None


def release_freed_memory() -> None:
    """Give freed heap pages back to the OS so RSS really falls (glibc keeps them otherwise)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def build_linears(stored: StoredLayer, device: torch.device) -> tuple[dict[str, Linear], dict[str, torch.Tensor]]:
    """Modules for a stored layer on `device`: the 7 linears and the 2 norm weights to install."""
    if isinstance(stored, LayerWeights):
        bias = {n: b.to(device) for n, b in stored.biases.items()}
        linears = {n: DenseLinear(w.to(device), bias.get(n)) for n, w in stored.linears.items()}
    else:
        linears = stored.build_linears(device)
    return linears, {n: t.to(device) for n, t in stored.norms.items()}


class LayerSwapper:
    """Owns the layers' precisions. Call `move` only at a step boundary (no step is running)."""

    def __init__(self, model: Transformer, store: HostStore, ledger: MemoryLedger, kv_resizer: KVResizer,
                 packed: PackedStore | None = None):
        self.model, self.store, self.ledger, self.kv_resizer = model, store, ledger, kv_resizer
        self.packed = packed  # full precision in oneDNN's layout, when the model runs pre-packed layers
        self.device = model.device
        self._prefetched: dict[tuple[int, Precision], Future] = {}
        self._heap_backed = set(range(len(model.layers)))  # layers whose weights live on the heap (the loader's)
        self._workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="morph-prefetch")
        # Kept here, not read off the modules: the engine thread asks for them every round, and walking
        # 30 layers' linears each time took ~6% of a busy replica's loop (py-spy, 40-request burst).
        self._precisions = tuple(layer_precision(model, i) for i in range(len(model.layers)))

    def precision_of(self, layer: int) -> Precision:
        return self._precisions[layer]

    def precisions(self) -> tuple[Precision, ...]:
        return self._precisions

    def check_integrity(self) -> None:
        """The kept precisions are the modules' (every swap goes through _switch)."""
        held = tuple(layer_precision(self.model, i) for i in range(len(self.model.layers)))
        if held != self._precisions:
            raise AssertionError(f"layer precisions drifted: kept {self._precisions}, modules hold {held}")

    def load(self, layer: int, precision: Precision) -> tuple[dict[str, Linear], dict[str, torch.Tensor]]:
        # From the PackedStore: views of the variant exactly as the kernels hold it (no copy, no packing).
        # Else one copy from the host store's map (INT4 in the kernel's layout when stored so).
        if self._from_packed_store(layer, precision):
            if precision.is_full:
                return self.packed.read_full(layer)
            return build_linears(self.packed.read_quantized(layer, precision), self.device)
        return build_linears(self.store.read(layer, precision, self.device), self.device)

    def _from_packed_store(self, layer: int, precision: Precision) -> bool:
        if self.packed is None or (precision.is_full and not self.model.layers[layer].pack):
            return False
        return self.packed.has(layer, precision)

    def _heap_backed_load(self, layer: int, precision: Precision) -> bool:
        """Whether a load of this variant leaves the layer's weights on the heap: not on a CPU (the host's
        allocator), or packed at the switch (oneDNN allocates the packed copy)."""
        if self.device.type != "cpu":
            return True
        return precision.is_full and self.model.layers[layer].pack and not self._from_packed_store(layer, precision)

    def prefetch(self, layer: int, precision: Precision) -> None:
        """Start loading a variant on the worker thread (down moves only, see the module docstring),
        its bytes claimed in the ledger first; nothing happens when they do not fit."""
        key = (layer, precision)
        if key in self._prefetched or len(self._prefetched) >= _MAX_PREFETCHED:
            return
        nbytes = self.store.layer_bytes(layer, precision)
        if nbytes >= self.ledger.layer_weights(layer):
            return
        try:
            self.ledger.stage(key, nbytes)
        except RuntimeError:  # no free bytes for it now: the switch loads it instead
            return
        self._prefetched[key] = self._workers.submit(self.load, layer, precision)

    def wait_prefetched(self) -> None:
        """Block until every prefetch in flight has finished loading (what the step between two morph
        boundaries gives the worker; benchmarks and tests call it instead of sleeping)."""
        for future in list(self._prefetched.values()):
            future.exception()  # waits; a failed load is raised where the switch takes it

    def _drop_prefetched(self, key: tuple[int, Precision]) -> None:
        """Forget a prefetch; a load already running is waited for, so the ledger never lets go of bytes
        that are still being filled."""
        future = self._prefetched.pop(key)
        if not future.cancel():
            future.exception()  # waits; a failed load holds nothing
        self.ledger.unstage(key)

    def _take_loaded(self, layer: int, precision: Precision):
        future = self._prefetched.pop((layer, precision), None)
        for key in [k for k in self._prefetched if k[0] == layer]:  # other variants of it are stale now
            self._drop_prefetched(key)
        if future is None:
            return self.load(layer, precision)
        try:
            return future.result()
        finally:
            self.ledger.unstage((layer, precision))  # installed now (counted as the layer's) or failed

    def move(self, layer: int, target: Precision, grow_kv: bool = True) -> SwapResult:
        """Move the layer to `target`. `grow_kv=False`: a down move leaves the bytes it frees to the caller
        (the executor lets prefetches claim theirs first, then grows the KV cache once)."""
        before = self.precision_of(layer)
        if target == before:
            return SwapResult(layer, before, before, "noop", message=f"layer {layer} is already {target.value}")
        target_bytes = self.store.layer_bytes(layer, target)
        if target_bytes <= self.ledger.layer_weights(layer):
            return self._down(layer, before, target, grow_kv)
        return self._up(layer, before, target, target_bytes)

    def _switch(self, layer: int, target: Precision) -> float:
        """Install the variant and drop the old copy; seconds taken."""
        t0 = time.perf_counter()
        heap_backed_now, heap_backed_next = layer in self._heap_backed, self._heap_backed_load(layer, target)
        linears, norms = self._take_loaded(layer, target)
        self.model.layers[layer].set_weights(linears, norms)
        self._precisions = self._precisions[:layer] + (target,) + self._precisions[layer + 1:]
        del linears, norms  # the layer now holds the only references; the old modules are garbage
        (self._heap_backed.add if heap_backed_next else self._heap_backed.discard)(layer)
        if heap_backed_now:  # page-buffered weights were unmapped as they were dropped
            release_freed_memory()
        return time.perf_counter() - t0

    def _down(self, layer: int, before: Precision, target: Precision, grow_kv: bool) -> SwapResult:
        old_bytes = self.ledger.layer_weights(layer)
        try:
            swap_s = self._switch(layer, target)
        except ModelLoadError as e:
            return SwapResult(layer, before, before, "rejected", message=str(e))
        self.ledger.set_layer_weights(layer, self.model.layer_weight_bytes(layer))
        grown = self.kv_resizer.grow(self.kv_resizer.growable_blocks()) if grow_kv else None
        return SwapResult(layer, before, target, "done", self.ledger.layer_weights(layer) - old_bytes,
                          grown.blocks_delta if grown else 0, 0, swap_s, grown.seconds if grown else 0.0)

    def _up(self, layer: int, before: Precision, target: Precision, target_bytes: int) -> SwapResult:
        old_bytes = self.ledger.layer_weights(layer)
        shortfall = target_bytes - old_bytes - max(0, self.ledger.free)
        block_bytes = self.kv_resizer.storage.block_bytes
        blocks = -(-shortfall // block_bytes) if shortfall > 0 else 0
        pool = self.kv_resizer.pool
        if blocks > pool.capacity - self.kv_resizer.min_blocks:
            return SwapResult(layer, before, before, "rejected", message=(
                f"layer {layer} at {target.value} needs {shortfall} more bytes; giving up {blocks} KV blocks would "
                f"leave fewer than {self.kv_resizer.min_blocks} (one max_model_len request). Raise memory_budget."))
        shrunk = self.kv_resizer.shrink(blocks) if blocks else None
        if shrunk is not None and shrunk.status != "done":
            return SwapResult(layer, before, before, "waiting", message=(
                f"layer {layer} -> {target.value} waits for {blocks} KV blocks: {shrunk.message}"))
        kv_delta = shrunk.blocks_delta if shrunk else 0
        resize_s = shrunk.seconds if shrunk else 0.0
        migrated = shrunk.blocks_migrated if shrunk else 0
        self.ledger.set_layer_weights(layer, target_bytes)  # claim before loading
        try:
            swap_s = self._switch(layer, target)
        except ModelLoadError as e:
            self.ledger.set_layer_weights(layer, old_bytes)
            regrown = self.kv_resizer.grow(self.kv_resizer.growable_blocks())
            return SwapResult(layer, before, before, "rejected", 0, kv_delta + regrown.blocks_delta, migrated,
                              0.0, resize_s + regrown.seconds, message=str(e))
        actual = self.model.layer_weight_bytes(layer)
        if actual != target_bytes:  # the manifest and the built modules disagree: trust the modules
            logger.warning("layer %d at %s holds %d bytes, the host store said %d", layer, target.value, actual, target_bytes)
            self.ledger.set_layer_weights(layer, actual)
        return SwapResult(layer, before, target, "done", actual - old_bytes, kv_delta, migrated, swap_s, resize_s)

    def close(self) -> None:
        for key in list(self._prefetched):
            self._drop_prefetched(key)
        self._workers.shutdown(wait=True)
