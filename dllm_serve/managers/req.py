"""`Req`: the scheduler's record of one request.

Lengths (one vocabulary, used everywhere):
- prompt_len: prompt tokens. Blocks sit at absolute positions that are multiples of block_size.
- prefill_end = prompt_len rounded down to a block: the prompt's whole blocks, prefilled first.
- committed_len: positions whose tokens are final and whose KV is cached (a multiple of
  block_size). While generating, the block being denoised starts at block_start = committed_len;
  the first generation block starts with the prompt's tail (prompt_len - prefill_end tokens).
- max_end: prompt_len + max_new_tokens rounded up to a block: the most positions ever cached.
- At admission committed_len starts at the prompt's prefix found in the radix cache (whole
  pages, shared with other requests); only the rest is prefilled.
While a request's blocks are on the device the worker owns them (managers/messages.py); the
scheduler learns of each block when it retires, and `committed_len` advances. When the blocks
leave the device unfinished (a preemption), the worker's report fills `dllm_incomplete_ids`
(n, block_size) (one block, or up to W with a wavefront; contiguous from block_start) and
`dllm_algo_state` (n opaque states), which the next admission sends back; both are None
otherwise. The scheduler never looks inside a state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dllm_serve.mem.allocator import Holding
from dllm_serve.sampling_params import SamplingParams
from dllm_serve.utils.text import GrowingText


def align_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(eq=False)  # identity: a request is equal only to itself
class Req:
    rid: str
    input_ids: np.ndarray  # (prompt_len,) int64
    params: SamplingParams
    arrival: float
    block_size: int
    seed: int
    uid: int = -1  # the worker's name for this admission (unique per admission)
    on_device: bool = False  # its blocks are in the worker's batch (or on their way)
    output_ids: list[int] = field(default_factory=list)
    holding: Holding | None = None  # slot and pages, once admitted
    mapped_pages: int = 0  # leading pages of holding.pages the worker has mapped
    committed_len: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache gave at admission
    dllm_incomplete_ids: np.ndarray | None = None  # (n, block_size) int64
    dllm_algo_state: list[dict[str, np.ndarray] | None] | None = None  # n states
    block_steps: list[int] = field(default_factory=list)  # forwards each unfinished block had
    block_forwards: list[int] = field(default_factory=list)  # forwards each block took to finish
    block_edits: list[int] = field(default_factory=list)  # T2T edits in each committed block
    forward_steps: int = 0
    denoise_steps: int = 0  # forwards excluding prefill
    prefill_forwards: int = 0
    blocks: int = 0
    finish_reason: dict[str, Any] | None = None
    stops: frozenset[int] | None = None  # its stop token ids (FinishChecker.stop_set), once known
    text: GrowingText | None = None  # its output's text, for a stop_regex (FinishChecker)

    # fixed at creation (the prompt and max_new_tokens never change): plain attributes, read
    # several times per committed block
    prompt_len: int = field(init=False)
    prefill_end: int = field(init=False)
    max_end: int = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.input_ids)
        self.prefill_end = self.prompt_len // self.block_size * self.block_size
        self.max_end = align_up(self.prompt_len + self.params.max_new_tokens, self.block_size)

    @property
    def needs_prefill(self) -> bool:
        return self.committed_len < self.prefill_end

    @property
    def block_start(self) -> int:
        return self.committed_len

    @property
    def block_end(self) -> int:
        return self.committed_len + self.block_size

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def current_blocks(self, mask_id: int) -> np.ndarray:
        """(n, block_size): the unfinished blocks, or one fresh block (prompt tail + masks)."""
        if self.dllm_incomplete_ids is not None:
            return self.dllm_incomplete_ids
        ids = np.empty((1, self.block_size), dtype=np.int64)
        ids.fill(mask_id)  # (np.full: twice the time)
        tail = self.input_ids[self.committed_len:self.block_end]
        ids[0, : len(tail)] = tail
        return ids

    def tokens(self, start: int, end: int) -> np.ndarray:
        """The token ids at positions [start, end) of prompt + output."""
        p = self.prompt_len
        if start >= p:  # all output (a committed block's pages)
            return np.asarray(self.output_ids[start - p:end - p], dtype=np.int64)
        head = self.input_ids[start:min(end, p)].astype(np.int64, copy=False)
        if end <= p:
            return head
        tail = np.asarray(self.output_ids[:end - p], dtype=np.int64)
        return np.concatenate([head, tail])

    def generated_part(self, block: np.ndarray) -> np.ndarray:
        """The block's tokens that are output, i.e. past the prompt."""
        return block[max(0, self.prompt_len - self.block_start):]
