"""`ReqPages`: the scheduler's side of each running request's KV pages.

It carries the allocator's pages (mem/allocator.py) to the worker as `AddPages`, and running
requests' final pages into the radix prefix cache:
- at admission a request's page table starts with the cached prefix of its prompt (whole pages,
  shared; its committed_len starts there, so only the rest is prefilled), and is mapped
  `mapped_blocks` ahead of the blocks the worker may open, then topped up as blocks commit;
- a request's whole pages enter the cache once their KV is final: prompt pages when their
  prefill forwards are queued, output pages when their last block is committed. Both may be
  shared at once: every later forward of any request runs after those forwards (one ordered
  channel to the worker, one device stream), and no request writes below its committed_len.
It counts prompt tokens taken from the cache (hit) and computed (miss), at admission.
"""

from __future__ import annotations

import numpy as np

from dllm_serve.managers.messages import AddPages, WorkItem
from dllm_serve.managers.req import Req
from dllm_serve.managers.scheduler_config import LOOKAHEAD_BLOCKS, SchedulerConfig
from dllm_serve.mem.allocator import KVAllocator
from dllm_serve.mem.radix_cache import Match


class ReqPages:
    def __init__(self, alloc: KVAllocator, config: SchedulerConfig,
                 to_worker: list[WorkItem]) -> None:
        self.alloc = alloc
        self.config = config
        self.to_worker = to_worker  # the scheduler's outgoing changes (shared list)
        self.prompt_tokens = {"hit_tokens": 0, "miss_tokens": 0}

    def start(self, req: Req, match: Match | None) -> None:
        """Admit `req` into the allocator: a slot, the cached prefix `match` (committed at
        once), pages reserved for the rest, and its first pages mapped on the worker."""
        req.holding = self.alloc.admit(req.max_end, match)
        req.committed_len = req.cached_tokens = self.alloc.cached_end(req.holding)
        self.prompt_tokens["hit_tokens"] += req.committed_len
        self.prompt_tokens["miss_tokens"] += req.prompt_len - req.committed_len
        self.map(req, req.prefill_end + self.config.mapped_blocks * self.config.block_size)

    def top_up(self, req: Req) -> None:
        """Map pages ahead again once fewer than half the lookahead blocks are left (so a page
        message goes out every few blocks, not after each)."""
        assert req.holding is not None
        k = self.config.block_size
        ahead = len(req.holding.pages) * self.config.page_size - req.committed_len
        if ahead < (self.config.mapped_blocks - LOOKAHEAD_BLOCKS // 2) * k:
            self.map(req, req.committed_len + self.config.mapped_blocks * k)

    def map(self, req: Req, end: int) -> None:
        """Map the request's pages up to min(end, max_end) on the worker (pages it has not
        mapped yet: at admission the cached prefix too)."""
        h = req.holding
        assert h is not None and h.slot is not None
        self.alloc.ensure(h, min(end, req.max_end))
        first = req.mapped_pages
        if len(h.pages) > first:
            self.to_worker.append(AddPages(h.slot, first, np.asarray(h.pages[first:],
                                                                     dtype=np.int64)))
            req.mapped_pages = len(h.pages)

    def cache(self, req: Req, added: np.ndarray | None = None) -> None:
        """Offer the request's newly final whole pages to the prefix cache: its committed
        positions whose tokens are known (a finished request's output may stop inside its
        last block; the tokens past the stop are in the KV but not in output_ids). added:
        the output tokens the last commit appended (int64), where the pages' tokens are
        sliced from when they all lie among them (no conversion of the output list)."""
        h = req.holding
        if self.alloc.tree is None or h is None:
            return
        start = self.alloc.cached_end(h)
        out_end = req.prompt_len + len(req.output_ids)
        end = min(req.committed_len, out_end)
        if end - start < self.config.page_size:
            return
        first = out_end - (0 if added is None else len(added))  # position of added[0]
        self.alloc.cache(h, req.tokens(start, end) if added is None or start < first
                         else added[start - first:end - first])
