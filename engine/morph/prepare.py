"""Build a model's host store (and, with --profile, its layer-importance profile), once.

    python -m engine.morph.prepare [--model default] [--dtype bf16] [--awq-checkpoint DIR]
                                   [--calibration sharegpt|wikitext2|none|FILE] [--profile]

The engine builds its host store on start-up (engine/engine_builder.py), so running this by hand is
only a way to pay the build before the first start; the store is the same one (same key) when the
options match the engine's config. With --profile it also writes the LIS profile where the engine
looks for it first (engine/morph/swap_order.py: prepared_profile_path).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.loader import load_model
from engine.morph import profiler
from engine.morph.store_builder import ensure_host_store, store_spec_for
from engine.morph.swap_order import prepared_profile_path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.morph.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--awq-checkpoint", default=None, help="AutoAWQ / compressed-tensors INT4 folder")
    ap.add_argument("--calibration", default="sharegpt",
                    help="AWQ calibration text: sharegpt, wikitext2, none (RTN INT4) or a text file")
    ap.add_argument("--ladder", default="int8,int4")
    ap.add_argument("--int4-group-size", type=int, default=128)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--profile", action="store_true", help="also compute the layer-importance profile")
    args = ap.parse_args(argv)
    config = EngineConfig(model=args.model, dtype=args.dtype, int4_checkpoint=args.awq_checkpoint,
                          calibration=args.calibration, morph_ladder=tuple(args.ladder.split(",")),
                          int4_group_size=args.int4_group_size, cache_dir=args.cache_dir)
    loaded = load_model(config.model, config.torch_dtype, "cpu", config.cache_path)
    t0 = time.perf_counter()
    store = ensure_host_store(loaded.model, store_spec_for(config, loaded.files.name, loaded.files.hf_dir),
                              config.cache_path, loaded.tokenizer)
    m = store.manifest
    print(f"host store {store.path}: {m.num_layers} layers x {list(m.precisions)}, int4 by {m.int4_method} "
          f"(calibration {m.calibration.get('source', '-')}), built in {m.build_seconds:.1f}s "
          f"(this call {time.perf_counter() - t0:.1f}s)")
    if args.profile:
        out = prepared_profile_path(config.cache_path, loaded.files.name)
        calibration = args.calibration if args.calibration != "none" else "sharegpt"
        profiler.main(["--model", str(config.model), "--group-size", str(config.int4_group_size),
                       "--calibration", calibration, "--cache-dir", str(config.cache_path), "--out", str(out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
