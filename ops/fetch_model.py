"""Download a Hugging Face model folder into the model cache, once: the KubeRay init container.

    python -m ops.fetch_model Qwen/Qwen2.5-0.5B-Instruct [--revision main] [--cache DIR]
    -> prints the folder to pass as the app's `model` arg: <cache>/models/Qwen--Qwen2.5-0.5B-Instruct

An empty repo id is a no-op (the default model is embedded in the image). A folder that already
holds config.json is kept as it is (the volume outlives pods); concurrent pods on a shared volume
take turns through the cache's build lock. Gated models read the token from $HF_TOKEN.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from engine.cache_lock import exclusive_build
from engine.config import default_cache_dir

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
Downloader = Callable[..., str]


def model_dir(cache: Path, repo_id: str) -> Path:
    return cache / "models" / repo_id.replace("/", "--")


def fetch(repo_id: str, cache: Path, revision: str | None = None, download: Downloader | None = None) -> Path | None:
    """The model's folder under `cache` (downloaded unless present); None for an empty repo id."""
    repo_id = repo_id.strip()
    if not repo_id:
        return None
    if not _REPO_ID.match(repo_id):
        raise ValueError(f"{repo_id!r} is not a Hugging Face repo id (owner/name)")
    dest = model_dir(cache, repo_id)
    with exclusive_build(dest.parent, f".{dest.name}.lock", f"the download of {repo_id}"):
        if (dest / "config.json").is_file():
            return dest
        if download is None:
            from huggingface_hub import snapshot_download as download
        download(repo_id=repo_id, revision=revision, local_dir=str(dest),
                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        if not (dest / "config.json").is_file():
            raise RuntimeError(f"{repo_id} has no config.json; it is not a transformers model folder")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo_id", help="owner/name on the Hugging Face Hub; empty: nothing to do")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--cache", type=Path, default=None, help="default: $MORPHSERVE_CACHE or ~/.cache/morphserve")
    args = parser.parse_args(argv)
    folder = fetch(args.repo_id, args.cache or default_cache_dir(), args.revision)
    print(folder if folder is not None else "no model to fetch (the default model is embedded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
