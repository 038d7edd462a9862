"""`PrefillPlanner`: packs admitted requests' prompt blocks into prefill forwards.

A forward holds at most chunked_prefill_size prompt tokens (whole blocks), several requests'
segments side by side; a request's prompt may span several forwards. Forwards go to the worker
in order as they fill (`send` sends the last, partly filled one). Once a forward is sent, the
prompt pages it writes enter the radix prefix cache (ReqPages.cache), so a request admitted
after it in the same round can share them: its own forwards come later in the same ordered
channel and device stream, after the one that writes them.

On the worker's side, `merge_prefills` merges the prefills that arrive together into fewer
forwards.
"""

from __future__ import annotations

import numpy as np

from dllm_serve.managers.messages import Preempt, Prefill, Release, WorkItem
from dllm_serve.managers.req import Req
from dllm_serve.managers.req_pages import ReqPages
from dllm_serve.managers.scheduler_config import SchedulerConfig
from dllm_serve.model.buckets import prefill_budget


class PrefillPlanner:
    def __init__(self, config: SchedulerConfig, to_worker: list[WorkItem], pages: ReqPages,
                 stats: dict[str, int]) -> None:
        self.budget = prefill_budget(config.chunked_prefill_size, config.block_size)
        self.to_worker = to_worker  # the scheduler's outgoing changes (shared list)
        self.pages = pages
        self.stats = stats  # the scheduler's counters (shared dict)
        self.work, self.reqs, self.left = Prefill([], [], []), [], self.budget

    def add(self, req: Req) -> None:
        """Add the request's prompt blocks past committed_len (which advances over them)."""
        while req.needs_prefill:
            if self.left == 0:
                self.send()
            end = min(req.prefill_end, req.committed_len + self.left)
            assert req.holding is not None and req.holding.slot is not None
            self.work.slots.append(req.holding.slot)
            self.work.seg_starts.append(req.committed_len)
            self.work.token_ids.append(req.input_ids[req.committed_len:end].astype(np.int64))
            self.left -= end - req.committed_len
            if req not in self.reqs:
                self.reqs.append(req)
            req.committed_len = end
            req.forward_steps += 1
            req.prefill_forwards += 1

    def send(self) -> None:
        """Send the open forward (if it has anything); then cache its requests' pages."""
        work, reqs = self.work, self.reqs
        self.work, self.reqs, self.left = Prefill([], [], []), [], self.budget
        if not work.slots:
            return
        self.to_worker.append(work)
        for key in ("prefill_rounds", "rounds", "forwards"):
            self.stats[key] += 1
        for req in reqs:
            self.pages.cache(req)


def merge_prefills(items: list[WorkItem], max_tokens: int) -> list[WorkItem]:
    """The items with prefills that arrived together merged into fewer forwards (each at most
    max_tokens). A merged prefill runs after the other items that came with its parts (the page
    mappings it needs among them; admissions only join at the next launch), but before any
    Release or Preempt that follows (a released slot may be remapped right after)."""
    out: list[WorkItem] = []
    merged: Prefill | None = None
    for item in items:
        if isinstance(item, Prefill):
            tokens = sum(len(t) for t in item.token_ids)
            if merged is not None and sum(len(t) for t in merged.token_ids) + tokens <= max_tokens:
                merged.slots += item.slots
                merged.seg_starts += item.seg_starts
                merged.token_ids += item.token_ids
                continue
            if merged is not None:
                out.append(merged)
            merged = Prefill(list(item.slots), list(item.seg_starts), list(item.token_ids))
            continue
        if merged is not None and isinstance(item, Release | Preempt):
            out.append(merged)
            merged = None
        out.append(item)
    if merged is not None:
        out.append(merged)
    return out
