"""SchedulerOutput -> input tensors -> model -> fp32 logits.

The runner turns the scheduler's chunks into one flat batch, decodes (one-token chunks) first so the
attention runs them in one batched call, then the multi-token prefill chunks:

    chunk order:  [P0 (3 tok)] [D1] [D2]       ->  rows: D1 D2 P0 P0 P0   (logits back in chunk order)

It builds the positions, the slot of every new token (block = block_table[p // bs], offset = p % bs)
and the `AttentionMetadata` once per step; every layer reuses them. KV views are fetched from the
storage every step because a KV resize may move them.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Literal

import torch

from engine.batch import ScheduledChunk, SchedulerOutput
from engine.capability import detect_capability
from engine.kernels import available_reason
from engine.layers.attention import (AttentionMetadata, DecodeBatch, PagedRuns, PrefillChunk, causal_op_supported,
                                    in_place_supported)
from engine.layers.packed import packing_available
from engine.model import Transformer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # [N] long: the row of the last token of each chunk needing logits, in chunk order
    chunk_rows: tuple[tuple[int, int], ...] = ()  # (first row, last row + 1) of every chunk, in chunk order


def _num_blocks(num_positions: int, block_size: int) -> int:
    return -(-num_positions // block_size)


class ModelRunner:
    """`storage` offers `layer(l) -> (k, v)`, each [max_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, model: Transformer, storage, device: torch.device | str,
                 attention: Literal["auto", "in_place", "gather"] = "auto",
                 linears: Literal["auto", "plain"] = "auto"):
        """attention: "auto" reads the paged cache in place where the kernel serves this model (CPU,
        fp32/bf16, built), else gathers; "gather" forces the torch route (benchmarks compare both).
        linears: "auto" pre-packs the full-precision linears where it pays (engine/layers/packed.py);
        "plain" keeps DenseLinear and F.linear (benchmarks and the fused-dense tests)."""
        self.model, self.storage, self.device = model, storage, torch.device(device)
        self.num_layers = model.config.num_layers
        self.capability = detect_capability(self.device)
        if linears == "auto" and packing_available(model.dtype, self.device):
            model.pack_linears()  # same bytes, so the ledger is unchanged
        supported = in_place_supported(model.dtype, self.device)
        if attention == "in_place" and not supported:
            raise ValueError(f"in-place attention does not serve {model.dtype} on {self.device} here "
                             f"({available_reason() or 'CPU with float32 or bfloat16 only'})")
        self.in_place_attention = supported and attention != "gather"
        self.causal_op = causal_op_supported(model.dtype, self.device, model.config.head_dim)
        logger.info("device %s; model dtype %s; attention %s", self.capability.describe(),
                    str(model.dtype).removeprefix("torch."), "in place" if self.in_place_attention else "gather")

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """fp32 logits [number of chunks with needs_logits, vocab], in chunk order."""
        return self.execute_with_chunk_logits(out, ())[0]

    def execute_with_chunk_logits(self, out: SchedulerOutput, every_row_of: Sequence[int]
                                  ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """As `execute`, plus the logits of every token of the chunks at indices `every_row_of`
        ({chunk index: [len(chunk.token_ids), vocab]}): what prompt logprobs are read from."""
        with torch.inference_mode():
            if out.is_empty:
                return torch.empty(0, self.model.config.vocab_size, device=self.device), {}
            kv = [self.storage.layer(l) for l in range(self.num_layers)]
            inputs = self.prepare(out.chunks, block_size=kv[0][0].shape[1])
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, kv)  # [T, H]
            sampled = self.model.compute_logits(hidden.index_select(0, inputs.logit_rows))
            every = {i: self.model.compute_logits(hidden[slice(*inputs.chunk_rows[i])]) for i in every_row_of}
            return sampled, every

    def prepare(self, chunks: Sequence[ScheduledChunk], block_size: int) -> StepInputs:
        order = ([i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
                 + [i for i, c in enumerate(chunks) if len(c.token_ids) != 1])
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        offsets: list[int] = []
        last_row = [0] * len(chunks)
        first_row = [0] * len(chunks)
        for i in order:
            c = chunks[i]
            self._check_chunk(c, block_size)
            first_row[i] = len(ids)
            ids.extend(c.token_ids)
            table = c.block_table
            for p in range(c.start_pos, c.end_pos):
                blocks.append(table[p // block_size])
                offsets.append(p % block_size)
            positions.extend(range(c.start_pos, c.end_pos))
            last_row[i] = len(ids) - 1
        num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
        decodes = [chunks[i] for i in order[:num_decodes]]
        meta = AttentionMetadata(
            write_blocks=self._long(blocks), write_offsets=self._long(offsets),
            decode=None if self.in_place_attention else self._decode_batch(decodes, block_size),
            prefills=self._prefill_chunks([chunks[i] for i in order[num_decodes:]], num_decodes, block_size),
            paged=self._paged_runs(decodes, block_size) if self.in_place_attention else None,
            causal_op=self.causal_op)
        logit_rows = [last_row[i] for i, c in enumerate(chunks) if c.needs_logits]
        return StepInputs(self._long(ids), self._long(positions), meta, self._long(logit_rows),
                          tuple((first_row[i], last_row[i] + 1) for i in range(len(chunks))))

    def _check_chunk(self, c: ScheduledChunk, block_size: int) -> None:
        # Caller bugs, not user input: the scheduler guarantees these; fail loudly before touching memory.
        if not c.token_ids:
            raise ValueError(f"request {c.request_id}: a scheduled chunk has no tokens")
        if c.end_pos > self.model.max_positions:
            raise ValueError(f"request {c.request_id}: position {c.end_pos - 1} is beyond the model's "
                             f"max_position_embeddings={self.model.max_positions}")
        if len(c.block_table) * block_size < c.end_pos:
            raise ValueError(f"request {c.request_id}: block table of {len(c.block_table)} blocks x {block_size} "
                             f"cannot hold {c.end_pos} positions")
        vocab = self.model.config.vocab_size
        if min(c.token_ids) < 0 or max(c.token_ids) >= vocab:
            raise ValueError(f"request {c.request_id}: token ids must lie in [0, {vocab})")

    def _paged_runs(self, decodes: list[ScheduledChunk], block_size: int) -> PagedRuns | None:
        """The decodes (rows [0, len(decodes))) as one-row runs of the in-place kernel."""
        if not decodes:
            return None
        tables = [c.block_table[:_num_blocks(c.end_pos, block_size)] for c in decodes]
        width = max(len(t) for t in tables)
        n = len(decodes)
        return PagedRuns(torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.long),
                         torch.arange(n), torch.ones(n, dtype=torch.long),
                         torch.tensor([c.start_pos for c in decodes], dtype=torch.long))

    def _decode_batch(self, decodes: list[ScheduledChunk], block_size: int) -> DecodeBatch | None:
        if not decodes:
            return None
        lengths = [c.end_pos for c in decodes]
        width = max(_num_blocks(n, block_size) for n in lengths)
        # Pad with block 0 (any valid id would do): those keys are masked out.
        tables = [list(c.block_table[:width]) + [0] * (width - min(width, len(c.block_table))) for c in decodes]
        key_pos = torch.arange(width * block_size, device=self.device)
        padding = key_pos[None, :] >= self._long(lengths)[:, None]  # [B, S]
        bias = torch.zeros(padding.shape, dtype=torch.float32, device=self.device).masked_fill_(padding, float("-inf"))
        return DecodeBatch(len(decodes), self._long(tables), bias[:, None, None, :])

    def _prefill_chunks(self, prefills: list[ScheduledChunk], first_row: int,
                        block_size: int) -> tuple[PrefillChunk, ...]:
        out, row = [], first_row
        for c in prefills:
            n = len(c.token_ids)
            if c.start_pos == 0:
                out.append(PrefillChunk(row, row + n, 0, None, None))
            else:
                ids = self._long(c.block_table[:_num_blocks(c.end_pos, block_size)])
                mask = None
                if not self.causal_op:  # SDPA needs the causal mask with the chunk's offset
                    key_pos = torch.arange(c.end_pos, device=self.device)
                    query_pos = torch.arange(c.start_pos, c.end_pos, device=self.device)
                    mask = key_pos[None, :] <= query_pos[:, None]
                out.append(PrefillChunk(row, row + n, c.start_pos, ids, mask))
            row += n
        return tuple(out)

    def _long(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
