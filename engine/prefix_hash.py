"""Prefix digests: the content key of each full KV block of a token sequence.

A block's K/V depend on every token before it, so its key chains its parent's digest with its own
tokens: digest_i = sha256(digest_{i-1} || tag_i || tokens of block i), digest_{-1} = the root (a salt).
Two requests share block i exactly when their first (i + 1) * block_size tokens are equal and every
block up to it was computed under the same tag. sha256, not Python's hash: a collision would hand one
request another's K/V, and Python's tuple hash of small ints can be forged by a client (vLLM moved to
sha256 for the same reason).

The tag says whether the block's K/V were computed with every layer at full precision (EXACT) or
while some were quantized (MORPHED; `precision_tag`). K/V computed while morphed are not exact for the
full-precision model, so an engine at full precision reads only EXACT blocks: once it restores, no
request reads K/V computed while it was morphed, and they age out of the cache unused. A morphed engine
reads either, EXACT first (KVCacheManager): its answers are approximate already, whichever morph
computed the K/V, and a burst's morphs do not each throw the cache away.
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


EXACT, MORPHED = b"", b"~"  # the tags: every layer at full precision / some layer quantized


def precision_tag(layer_precisions: Sequence, full_precision) -> bytes:
    """The tag of K/V computed with these layer precisions."""
    return EXACT if all(p == full_precision for p in layer_precisions) else MORPHED


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
