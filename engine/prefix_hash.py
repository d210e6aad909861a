"""Prefix digests: the content key of each full KV block of a token sequence.

A block's K/V depend on every token before it, so its key chains its parent's digest with its own
tokens: digest_i = sha256(digest_{i-1} || tokens of block i), digest_{-1} = the root (a salt). Two
requests share block i exactly when their first (i + 1) * block_size tokens are equal. sha256, not
Python's hash: a collision would hand one request another's K/V, and Python's tuple hash of small
ints can be forged by a client (vLLM moved to sha256 for the same reason).
"""
from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

ROOT = b"morphserve-prefix-v1"  # digest_{-1}; a per-request salt would go here


def block_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array.array("q", tokens).tobytes()).digest()


def chain_digests(token_ids: Sequence[int], block_size: int, num_blocks: int, parent: bytes = ROOT) -> list[bytes]:
    """Digests of the first `num_blocks` full blocks of `token_ids` (fewer if the tokens run out)."""
    num_blocks = min(num_blocks, len(token_ids) // block_size)
    out = []
    for i in range(num_blocks):
        parent = block_digest(parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out
