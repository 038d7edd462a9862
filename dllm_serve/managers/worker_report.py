"""`ReportBuilder`: what the worker gathers between two reports to the scheduler.

Results (retired blocks, preempted and failed requests) go out with the next iteration's
report; counters alone go out at most every `every_s` seconds while busy (so the scheduler's
statistics, /metrics and /health_generate see progress), and at once when the worker goes idle.
"""

from __future__ import annotations

import time

import numpy as np

from dllm_serve.managers.batch_layout import Block
from dllm_serve.managers.messages import Failed, Preempted, Retired, WorkerReport


class ReportBuilder:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.msg = WorkerReport()
        self.retired: list[tuple[int, Block, int]] = []  # uid, block, request forwards
        self.last = time.monotonic()

    def retire(self, uid: int, block: Block, req_forwards: int) -> None:
        self.retired.append((uid, block, req_forwards))

    def preempted(self, p: Preempted) -> None:
        self.msg.preempted.append(p)

    def failed(self, f: Failed) -> None:
        self.msg.failed.append(f)

    def take(self, idle: bool) -> WorkerReport | None:
        """The report to send now, or None."""
        msg, now = self.msg, time.monotonic()
        counters = msg.forwards or msg.prefills or msg.compiles
        if not (self.retired or msg.has_results or (idle and counters)
                or (msg.forwards and now - self.last >= self.every_s)):
            return None
        if self.retired:
            msg.retired = _retired(self.retired)
        self.msg, self.retired, self.last = WorkerReport(), [], now
        return msg


def _retired(items: list[tuple[int, Block, int]]) -> Retired:
    """The blocks as one Retired: its per-block fields are the columns of one (R, 5) table
    (as Retired's unpickling makes them), two arrays built where six were."""
    head = np.array([(uid, b.start, b.final_step, b.edits, f) for uid, b, f in items],
                    dtype=np.int64)
    return Retired(uids=head[:, 0], starts=head[:, 1],
                   ids=np.array([b.ids for _, b, _ in items], dtype=np.int64),
                   forwards=head[:, 2], edits=head[:, 3], req_forwards=head[:, 4])
