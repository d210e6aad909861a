"""The morph executor: host store of per-layer variants, LayerSwapper, KVResizer, profiler."""
