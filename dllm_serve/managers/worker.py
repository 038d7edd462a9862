"""The worker: owns the device and runs one forward loop that never waits for the scheduler.

    loop: take changes -> launch forward k + step -> read step k-1 back -> retire / open
          blocks -> report what finished -> go on

The running batch lives on the device (`ResidentBatch`); the scheduler sends only changes
(pages, prefill, admissions, releases, preemptions) and receives only results (retired blocks,
preempted or failed requests). Forward k + 1 is launched before step k's readout is read, so
the device always has the next forward queued while the host does its bookkeeping. What the
host learns from step k is which blocks converged: their final forward is k + 1, already
queued, so they retire right after it and their places (the request's next block, a new
request) are taken in forward k + 2. FDFO and sync differ only in when blocks retire and new
requests join (dllm/modes.py).

Pipeline depth (--dllm-pipeline-depth; 1 by default, which measured as fast or faster on an
H200): with 2 the worker keeps two forwards queued instead of one, so its bookkeeping for
forward k overlaps forwards k + 1 and k + 2; with auto, on CUDA, two while the host is the
bottleneck (a readout is already there whenever the host comes for it: small models, many
requests) and one when the device is (the host waits for readouts). A converged block then
takes part in one more forward before it leaves (a no-op: a step changes nothing in a block
that is done on entry, and the reported forward count is its final one).

A failure inside one request (non-finite logits, no convergence within the algorithm's step
bound, an exception in its step) fails that request alone; anything else (a CUDA error, a bug)
propagates and stops the worker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm
from dllm_serve.dllm.denoise_step import FLAGS, StepSpec, denoise_step
from dllm_serve.dllm.modes import RoundMode, plan
from dllm_serve.managers.messages import (
    AddPages,
    Admit,
    Failed,
    Preempt,
    Preempted,
    Prefill,
    Release,
    WorkerReport,
    WorkItem,
)
from dllm_serve.managers.readback import Pending, Readback
from dllm_serve.managers.resident_batch import Block, DeviceReq, Layout, ResidentBatch
from dllm_serve.managers.round_trace import Tracer
from dllm_serve.managers.row_storage import RowStorage
from dllm_serve.managers.worker_report import ReportBuilder
from dllm_serve.model.denoise_run import DenoiseRun
from dllm_serve.model.head import Scores
from dllm_serve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

REPORT_EVERY_S = 0.02  # counters reach the scheduler at least this often while busy
# Pipeline depth (CUDA): the moving average of the host's wait for a readout; under LOW the
# host is the bottleneck (go to two forwards ahead), over HIGH the device is (back to one).
WAIT_LOW_S, WAIT_HIGH_S, WAIT_EMA = 5e-5, 1e-3, 0.2
CONVERGED, READY, BAD, EDITS = (FLAGS.index(f) for f in ("converged", "ready", "bad", "edits"))


@dataclass
class Launch:
    """A forward + step in flight: its layout, each row's step count, its readout."""

    layout: Layout
    steps: np.ndarray  # (N,) each row's forwards, this one included
    readout: Pending
    failed: list[DeviceReq]


class Worker:
    def __init__(self, runner: ModelRunner, algo: DllmAlgorithm, mode: RoundMode,
                 tracer: Tracer | None = None, report_every_s: float = REPORT_EVERY_S,
                 max_prefill_tokens: int = 4096, depth: int | None = None) -> None:
        """max_prefill_tokens: prefills that arrive together are merged into forwards of at
        most this many tokens (--chunked-prefill-size). depth: forwards kept queued while the
        host reads the oldest back; None: adaptive on CUDA (1 or 2), 1 elsewhere (a forward on
        the CPU runs while it is launched: nothing to overlap)."""
        self.runner, self.algo, self.mode = runner, algo, mode
        self.k = runner.block_size
        tau = mode.wavefront.token_threshold
        self.spec = StepSpec(mode.wavefront.size > 1,
                             algo.readiness_threshold() if tau is None else tau,
                             mode.wavefront.spawn_threshold)
        algo.bind_device(runner.device)
        rows = max(runner.max_requests * mode.wavefront.size, runner.graph_max_blocks)
        self.storage = RowStorage(algo, rows, self.k, runner.device, runner.scratch_slot)
        self.batch = ResidentBatch(algo, self.storage, runner.scratch_slot, runner.bucketed)
        runner.warm_up(self.storage.ids, self._graph_step if algo.graph_safe else None,
                       self.k + len(FLAGS), self.storage.apply_staged,
                       (self.storage.row_req, self.storage.row_start), self.storage.replayed)
        cuda = runner.device.type == "cuda"
        self.adaptive = depth is None and cuda
        self.depth = depth or 1
        self.wait_avg = WAIT_HIGH_S  # start at one forward ahead
        most = 2 if self.adaptive else self.depth  # the deepest this worker goes
        self.readback = Readback(runner.device, buffers=most + 1)
        self.tracer = tracer
        self.mapped: dict[int, int] = {}  # slot -> end of its mapped pages (tokens)
        self.waiting: list[DeviceReq] = []  # admitted, joining at once (sync: at a boundary)
        self.parked: list[DeviceReq] = []  # no block open: waiting for their pages
        # FDFO: every live request with a converged leftmost block or a ready frontier
        # (_advance's candidates) is here, by id: a refresh that flags one of its blocks adds it,
        # _advance keeps those it leaves candidates (only a refresh or _advance can make a
        # request one: blocks are opened and admitted unflagged)
        self.flagged: dict[int, DeviceReq] = {}
        self.inflight: deque[Launch] = deque()  # oldest first
        self.run: DenoiseRun | None = None
        self.prepared: Layout | None = None
        self.report = ReportBuilder(report_every_s)
        self.boundary = True  # sync: the last collect retired the whole batch
        self.wait_s = 0.0  # time spent waiting for the device's readouts (for the trace)
        # host seconds per phase of iterate (for the trace): the scheduler's changes (prefill
        # launches among them), join + launch, readback (its wait included) + retire / open
        self.phase_s = [0.0, 0.0, 0.0]
        self.max_steps = algo.max_steps(self.k)
        self.max_prefill_tokens = max_prefill_tokens

    def take_host_split(self) -> tuple[float, list[float]]:
        """The readout wait and the host seconds per phase since the last call (the trace's
        split of an iteration), reset to zero."""
        out = (self.wait_s, self.phase_s)
        self.wait_s, self.phase_s = 0.0, [0.0, 0.0, 0.0]
        return out

    @property
    def idle(self) -> bool:
        """Nothing on the device and nothing in flight: wait for the scheduler."""
        return self.batch.num_rows == 0 and not self.inflight and not self.waiting

    # ---- one iteration ------------------------------------------------------------------

    @torch.inference_mode()
    def iterate(self, items: list[WorkItem]) -> WorkerReport | None:
        """Apply the scheduler's changes, launch the next forward, read the previous one
        back; returns a report when there is one to send."""
        t0 = time.monotonic()
        for item in merge_prefills(items, self.max_prefill_tokens):
            self.apply(item)
        t1 = time.monotonic()
        self.join()
        launched = self.launch() if self.batch.num_rows else None
        if launched is not None:
            self.inflight.append(launched)
        t2 = time.monotonic()
        while self.inflight and (launched is None or len(self.inflight) > self.depth):
            self.collect(self.inflight.popleft())
        self.join()
        report = self.report.take(self.idle)
        phases = self.phase_s
        phases[0] += t1 - t0
        phases[1] += t2 - t1
        phases[2] += time.monotonic() - t2
        return report

    # ---- changes from the scheduler -----------------------------------------------------

    def apply(self, item: WorkItem) -> None:
        if isinstance(item, AddPages):
            self.runner.add_pages(item.slot, item.first, item.pages)
            base = 0 if item.first == 0 else self.mapped.get(item.slot, 0)
            end = (item.first + len(item.pages)) * self.runner.page_size
            self.mapped[item.slot] = max(base, end)
        elif isinstance(item, Prefill):
            self._trace("prefill", lambda: self.runner.prefill(item.slots, item.seg_starts,
                                                               item.token_ids))
            self.report.msg.prefills += 1
        elif isinstance(item, Admit):
            self.admit(item)
        elif isinstance(item, Release):
            self.release(item.uid)
        elif isinstance(item, Preempt):
            self.preempt(item.uid)
        else:
            raise TypeError(f"worker got an unexpected item {type(item).__name__}")

    def admit(self, msg: Admit) -> None:
        n = len(msg.blocks)
        blocks = [Block(msg.first_start + i * self.k, init_ids=msg.blocks[i].copy(),
                        init_state=msg.states[i], init_steps=msg.block_steps[i])
                  for i in range(n)]
        self.waiting.append(DeviceReq(msg.uid, msg.slot, msg.settings,
                                      msg.first_start + n * self.k, blocks))

    def _find(self, uid: int) -> DeviceReq | None:
        return self.batch.reqs.get(uid) or next((r for r in self.waiting if r.uid == uid), None)

    def release(self, uid: int) -> None:
        req = self._find(uid)
        if req is not None:
            self._remove(req)

    def preempt(self, uid: int) -> None:
        req = self._find(uid)
        if req is None:
            return
        ids, states = (self.batch.host_rows(req) if req.blocks
                       else (np.zeros((0, self.k), np.int64), []))
        self.report.preempted(Preempted(
            uid, req.first_start, ids, states, [self.batch.steps(b) for b in req.blocks],
            self.batch.forwards(req)))
        self._remove(req)

    def _remove(self, req: DeviceReq) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
            req.alive = False
        else:
            self.batch.drop(req)

    def fail(self, req: DeviceReq, message: str) -> None:
        if req.alive:
            logger.error("request uid %d failed: %s", req.uid, message)
            self.report.failed(Failed(req.uid, message))
            self._remove(req)

    # ---- the device -----------------------------------------------------------------------

    def launch(self) -> Launch:
        """Queue forward + step over the current layout; nothing waits for the device."""
        layout = self.batch.layout()
        if layout is not self.prepared:
            c = layout.cols
            self.run = self.runner.prepare_denoise(c.slots, c.first_starts,
                                                   layout.batch.num_blocks, layout.batch.block_ids)
            self.prepared = layout
        self.storage.flush()  # the layout's row writes: applied first thing in the forward
        assert self.run is not None
        run = self.run
        if run.step is not None and not layout.batch.sampled:  # one graph: forward + step
            readout, failed = self._trace("denoise", run.step, len(layout.rows)), []
        else:
            readout, failed = self._trace("denoise", lambda: denoise_step(
                self.algo, layout.batch, run.forward(), layout.state, self.spec),
                len(layout.rows))
        layout.batch.block_steps += 1
        self.batch.launched()
        self.report.msg.forwards += 1
        self.report.msg.block_steps += len(layout.rows)
        return Launch(layout, layout.steps.copy(), self.readback.start(readout),
                      [layout.reqs[i] for i in failed])

    # ---- results --------------------------------------------------------------------------

    def collect(self, launch: Launch) -> None:
        """Read step k back: refresh the flags of the blocks it says something new about, fail
        what must fail, then retire and open blocks as the mode says."""
        t0 = time.monotonic()
        data = launch.readout.get()
        self._adapt(time.monotonic() - t0)
        for req in launch.failed:
            self.fail(req, "the decoding algorithm raised an error while stepping this request")
        rows, owners = launch.layout.rows, launch.layout.reqs
        for i in self._notable(launch, data):
            if rows[i].alive:
                self._refresh(rows[i], owners[i], data[i], int(launch.steps[i]))
        self._advance()

    def _notable(self, launch: Launch, data: np.ndarray) -> list[int]:
        """The rows a readout `data` (N, K + 5) says something new about: bad, at the step
        bound, or flags (converged, ready) that differ from what the host knows of their
        blocks (refreshing any other live row changes nothing)."""
        k, rows = self.k, launch.layout.rows
        notable = (data[:, k + BAD] > 0) | (launch.steps >= self.max_steps)
        converged = data[:, k + CONVERGED] > 0
        if self.mode.fdfo and not self.spec.wavefront:  # a block leaves on the readout that
            notable |= converged  # finds it converged: no live row is known converged
        else:  # blocks stay converged (sync waits for the batch, a wavefront retires in order)
            n = len(rows)
            notable |= converged != np.fromiter((b.converged for b in rows), bool, n)
            if self.spec.wavefront:  # readiness is measured there only (else 0, as known)
                notable |= (data[:, k + READY] > 0) != np.fromiter((b.ready for b in rows),
                                                                  bool, n)
        return notable.nonzero()[0].tolist()  # (np.flatnonzero: twice the time)

    def _adapt(self, wait: float) -> None:
        """Count the wait; on CUDA choose the depth from its moving average (hysteresis)."""
        self.wait_s += wait
        if not self.adaptive:
            return
        self.wait_avg += WAIT_EMA * (wait - self.wait_avg)
        if self.depth == 1 and self.wait_avg < WAIT_LOW_S:
            self.depth = 2
        elif self.depth == 2 and self.wait_avg > WAIT_HIGH_S:
            self.depth = 1

    def _refresh(self, block: Block, req: DeviceReq, row: np.ndarray, steps: int) -> None:
        k = self.k
        converged = bool(row[k + CONVERGED])
        if converged and not block.converged:  # its final forward is the one after this step
            block.final_step = steps + 1
            block.ids, block.edits = row[:k].copy(), int(row[k + EDITS])
        block.converged = converged
        block.ready = bool(row[k + READY])
        if (converged or block.ready) and self.mode.fdfo:
            self.flagged[id(req)] = req
        if row[k + BAD]:
            self.fail(req, "the model produced non-finite logits for this request")
        elif not block.converged and steps >= self.max_steps:
            self.fail(req, f"a block did not converge within {self.max_steps} steps")

    def _advance(self) -> None:
        """Retire and open blocks. Only requests where something can happen are planned: a
        converged leftmost block, a ready frontier, or (sync) a batch that is all done."""
        any_active = self.batch.num_rows > 0  # some request has a block
        if self.mode.fdfo:  # after every forward: only the flagged requests (admission order)
            cands = sorted((r for r in self.flagged.values() if r.alive and _candidate(r)),
                           key=attrgetter("seq"))
            done = False
        else:
            active = [r for r in self.batch.reqs.values() if r.blocks]
            done = bool(active) and all(r.blocks[0].converged for r in active)
            cands = active if done else [r for r in active if r.blocks[-1].ready]
        if not cands:
            self.flagged.clear()
            self.boundary = not any_active
            return
        p = plan(self.mode, np.array([_leading(r.blocks) for r in cands], dtype=np.int64),
                 np.array([len(r.blocks) for r in cands], dtype=np.int64),
                 np.array([r.blocks[-1].ready for r in cands], dtype=bool),
                 np.array([self._can_open(r) for r in cands], dtype=bool), done)
        retire = p.retire.tolist()
        if any(retire):
            self.report.msg.rounds += 1
        for req, count, opens in zip(cands, retire, p.open.tolist(), strict=True):
            if count and not self._retire(req, count):
                continue
            if opens:
                self.batch.open_block(req)
            elif not req.blocks:
                self.parked.append(req)  # its next block's pages are not mapped yet
        if self.mode.fdfo:
            self.flagged = {id(r): r for r in cands if r.alive and _candidate(r)}
        self.boundary = p.boundary or not any_active

    def _retire(self, req: DeviceReq, count: int) -> bool:
        """Retire and report the request's leading blocks; False if it is over (a stop token
        or max_end: the worker forgets it, the scheduler finishes it on the report)."""
        forwards = self.batch.forwards(req)
        for block in self.batch.retire(req, count):
            self.report.msg.idle_block_steps += self.batch.steps(block) - block.final_step
            self.report.retire(req.uid, block, forwards)
            if self._stops(req, block):
                self.batch.drop(req)
                return False
        if not req.blocks and req.next_start >= req.settings.max_end:
            self.batch.drop(req)
            return False
        return True

    def _stops(self, req: DeviceReq, block: Block) -> bool:
        s = req.settings
        if block.start + self.k >= s.max_end:
            return True
        stops = s.stop_ids  # (m,), a few ids: one broadcast compare beats np.isin's sort
        if not len(stops) or block.ids is None:
            return False
        gen = block.ids[max(0, s.prompt_len - block.start):]
        return bool((gen[:, None] == stops[None, :]).any())

    def _can_open(self, req: DeviceReq) -> bool:
        end = req.next_start + self.k
        return end <= req.settings.max_end and end <= self.mapped.get(req.slot, 0)

    def join(self) -> None:
        """Admitted requests join, and requests without a block (pages were missing) open
        one: at once with FDFO; with sync at a batch boundary or when the batch is empty."""
        if not (self.mode.fdfo or self.boundary or self.batch.num_rows == 0):
            return
        for req in self.waiting:
            self.batch.add(req)
        self.waiting = []
        parked, self.parked = self.parked, []
        for req in parked:
            if req.alive and not req.blocks and self._can_open(req):
                self.batch.open_block(req)
            elif req.alive and not req.blocks:
                self.parked.append(req)
        self.boundary = False

    # ---- reports ------------------------------------------------------------------------

    def _trace(self, kind: str, fn, rows: int = 0):  # type: ignore[no-untyped-def]
        return fn() if self.tracer is None else self.tracer.run(kind, fn, rows)

    def _graph_step(self, bucket: int, logits: Scores) -> torch.Tensor:
        """The greedy step over storage rows [0, bucket), as captured after the forward."""
        _, state = self.storage.views(bucket)
        readout, _ = denoise_step(self.algo, self.storage.graph_batch(bucket), logits, state,
                                  self.spec, isolate=False)
        return readout


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


def _candidate(req: DeviceReq) -> bool:
    """Something can happen to the request in _advance: its leftmost block converged or its
    frontier is ready."""
    return bool(req.blocks) and (req.blocks[0].converged or req.blocks[-1].ready)


def _leading(blocks: list[Block]) -> int:
    """Converged blocks at the start of a window."""
    n = 0
    while n < len(blocks) and blocks[n].converged:
        n += 1
    return n
