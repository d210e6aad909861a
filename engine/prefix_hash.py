"""Prefix digests: the content key of each full KV block of a token sequence.

A block's K/V depend on every token before it, so its key chains its parent's digest with its own
tokens: digest_i = sha256(digest_{i-1} || tag_i || tokens of block i), digest_{-1} = the root (a salt).
Two requests share block i exactly when their first (i + 1) * block_size tokens are equal and every
block up to it was computed under the same tag. sha256, not Python's hash: a collision would hand one
request another's K/V, and Python's tuple hash of small ints can be forged by a client (vLLM moved to
sha256 for the same reason).

The tag is the layer precisions the block's K/V were computed at (`precision_tag`; empty at full
precision): K/V computed while layers were quantized are not exact for a full-precision model, so once
an engine restores, no request reads them again; they age out of the cache unused. A morphed engine
reuses only what was computed at its current precisions.
"""
from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

ROOT = b"morphserve-prefix-v1"  # digest_{-1} of an unsalted request


def root(cache_salt: str | None = None) -> bytes:
    """digest_{-1}: a request's `cache_salt` (vLLM's) starts its own chain, so only requests with the
    same salt share blocks."""
    return ROOT if cache_salt is None else hashlib.sha256(ROOT + b"|salt|" + cache_salt.encode()).digest()


def precision_tag(layer_precisions: Sequence, full_precision) -> bytes:
    """The tag of K/V computed with these layer precisions: b"" when every layer is at full precision."""
    if all(p == full_precision for p in layer_precisions):
        return b""
    return ",".join(str(getattr(p, "value", p)) for p in layer_precisions).encode()


def block_digest(parent: bytes, tokens: Sequence[int], tag: bytes = b"") -> bytes:
    return hashlib.sha256(parent + tag + b"|" + array.array("q", tokens).tobytes()).digest()


def chain_digests(token_ids: Sequence[int], block_size: int, num_blocks: int, parent: bytes = ROOT,
                  tag: bytes = b"") -> list[bytes]:
    """Digests of the first `num_blocks` full blocks of `token_ids` (fewer if the tokens run out), every
    block computed under `tag`."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    out = []
    for i in range(num_blocks):
        parent = block_digest(parent, token_ids[i * block_size:(i + 1) * block_size], tag)
        out.append(parent)
    return out
