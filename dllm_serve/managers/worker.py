"""The worker: owns the device and runs one forward loop that never waits for the scheduler.

    loop: launch forward k + step -> apply the scheduler's changes (CUDA; on the CPU they come
          first) -> read step k-1 back -> retire / open blocks (managers/block_flow.py) ->
          report what finished -> go on

The running batch lives on the device (`ResidentBatch`); the scheduler sends only changes
(pages, prefill, admissions, releases, preemptions) and receives only results (retired blocks,
preempted or failed requests). Forward k + 1 is launched before step k's readout is read, so the
device always has the next forward queued while the host does its bookkeeping. What the host learns
from step k is which blocks converged: their final forward is k + 1, already queued, so they retire
right after it and their places (the request's next block, a new request) are taken in forward k +
2, unless the successor was placed gated ahead of time (dllm/wavefront.py): the device then opens it
in forward k + 1 itself. FDFO and sync differ only in when blocks retire and new requests join
(dllm/modes.py). On CUDA the scheduler's costly changes (prefill launches, preemptions, and whatever
follows them) are applied after the launch, while forwards k - 1 and k are queued, so their host
work never holds the next forward back; the cheap ones that come first (page mappings, admissions,
releases: see `iterate`) go before it, so a request admitted without a prefill joins forward k
itself.

How far ahead of its bookkeeping the worker keeps the device (forwards queued while it reads
the oldest back, forwards launched per pass over one layout) is `Pacing`'s (managers/pacing.py).

A failure inside one request (non-finite logits, no convergence within the algorithm's step
bound, an exception in its step) fails that request alone; anything else (a CUDA error, a bug)
propagates and stops the worker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm
from dllm_serve.dllm.denoise_step import FLAGS, StepSpec, denoise_step
from dllm_serve.dllm.modes import RoundMode
from dllm_serve.managers.batch_layout import Block, DeviceReq, Layout
from dllm_serve.managers.block_flow import BlockFlow
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
from dllm_serve.managers.pacing import Pacing
from dllm_serve.managers.prefill_plan import merge_prefills
from dllm_serve.managers.readback import Pending, Readback
from dllm_serve.managers.resident_batch import ResidentBatch
from dllm_serve.managers.round_trace import Tracer
from dllm_serve.managers.row_storage import RowStorage
from dllm_serve.managers.worker_report import ReportBuilder
from dllm_serve.model.denoise_run import DenoiseRun
from dllm_serve.model.head import Scores
from dllm_serve.model.runner import ModelRunner

logger = logging.getLogger(__name__)

REPORT_EVERY_S = 0.02  # counters reach the scheduler at least this often while busy
CONVERGED, READY, BAD, EDITS, GATED = (FLAGS.index(f) for f in ("converged", "ready", "bad",
                                                                 "edits", "gated"))


@dataclass
class Launch:
    """A forward + step in flight: its layout, each row's step count, its readout."""

    layout: Layout
    steps: np.ndarray  # (N,) each row's forwards, this one included
    readout: Pending
    failed: list[DeviceReq]
    fetches: int  # the row storage's fetches queued up to this one's (it ran them once read)


class Worker:
    def __init__(self, runner: ModelRunner, algo: DllmAlgorithm, mode: RoundMode,
                 tracer: Tracer | None = None, report_every_s: float = REPORT_EVERY_S,
                 max_prefill_tokens: int = 4096, depth: int | None = None,
                 multi_step: int | None = 1) -> None:
        """max_prefill_tokens: prefills that arrive together are merged into forwards of at
        most this many tokens (--chunked-prefill-size). depth: forwards kept queued while the
        host reads the oldest back; multi_step: forwards launched over one layout per pass;
        each 1, 2 or None: auto on CUDA, 1 elsewhere (managers/pacing.py)."""
        self.runner, self.algo, self.mode = runner, algo, mode
        self.k = runner.block_size
        tau = mode.wavefront.token_threshold
        self.spec = StepSpec(mode.wavefront.size > 1,
                             algo.readiness_threshold() if tau is None else tau,
                             mode.wavefront.spawn_threshold)
        algo.bind_device(runner.device)
        rows = max(runner.max_requests * mode.rows_per_request, runner.graph_max_blocks)
        self.storage = RowStorage(algo, rows, self.k, runner.device, runner.scratch_slot,
                                  gated=mode.gate != 0, page_table=runner.page_table)
        self.batch = ResidentBatch(algo, self.storage, runner.scratch_slot, runner.bucketed)
        step = self._graph_step if algo.graph_safe else None  # captured after the forward
        runner.warm_up(self.storage.ids, step, self.k + len(FLAGS), self.storage.apply_staged,
                       (self.storage.row_req, self.storage.row_start), self.storage.replayed,
                       open_step=partial(step, gates_open=True) if step and mode.gate else None)
        cuda = runner.device.type == "cuda"
        self.pacing = Pacing(depth, multi_step, cuda)
        self.readback = Readback(runner.device, buffers=self.pacing.most_in_flight)
        self.tracer = tracer
        self.inflight: deque[Launch] = deque()  # oldest first
        self.run: DenoiseRun | None = None
        self.prepared: Layout | None = None
        self.report = ReportBuilder(report_every_s)
        self.flow = BlockFlow(self.batch, self.report, mode, self.k,  # retire / open / join
                              runner.max_requests)
        self.wait_s = 0.0  # time spent waiting for the device's readouts (for the trace)
        # host seconds per phase of iterate (for the trace): the scheduler's changes (prefill
        # launches among them), join + launch, readback (its wait included) + retire / open
        self.phase_s = [0.0, 0.0, 0.0]
        self.max_steps = algo.max_steps(self.k)
        self.gate = mode.gate  # blocks may wait in rows for their predecessor (wavefront.py)
        self.max_prefill_tokens = max_prefill_tokens

    def take_host_split(self) -> tuple[float, list[float]]:
        """The readout wait and the host seconds per phase since the last call (the trace's
        split of an iteration), reset to zero."""
        out = (self.wait_s, self.phase_s)
        self.wait_s, self.phase_s = 0.0, [0.0, 0.0, 0.0]
        return out

    def compiled(self, kernel: str, seconds: float) -> None:
        """A Triton kernel compiled after ready (kernels/compile_watch.py): a stall the warm-up
        should have prevented; logged by name, counted in the next report and traced."""
        logger.warning("Triton compiled %s after ready (%.2f s): a serving stall the warm-up "
                       "did not prevent", kernel, seconds)
        self.report.msg.compiles += 1
        if self.tracer is not None:
            self.tracer.compile(kernel, seconds)

    @property
    def idle(self) -> bool:
        """Nothing on the device, nothing in flight, no admitted request that may join: wait
        for the scheduler."""
        return self.batch.num_rows == 0 and not self.inflight and not self.flow.joinable

    # ---- one iteration ------------------------------------------------------------------

    def iterate(self, items: list[WorkItem]) -> WorkerReport | None:
        """Apply the scheduler's changes, launch the next forwards (`multi_step` of them over
        one layout), read the earlier ones back; returns a report when there is one to send.

        On a device that runs a launched forward while the host goes on (CUDA:
        `Pacing.overlap`) with blocks on it, only the leading run of cheap changes (page
        mappings, admissions, releases: tens of microseconds; a parked request waits for its
        pages, an admitted one without a prefill joins this launch) is applied before the
        forwards are launched; from the first prefill or preemption on, the changes are applied
        while they run: that host work (a prefill launch is hundreds of microseconds) then
        overlaps two queued forwards instead of delaying the next, and what it admits joins at
        the next launch (after its prefill, in stream order). Elsewhere (the CPU computes a
        forward inside its launch: nothing to overlap) the changes come first.

        Runs in inference mode: the worker process enters it once around its loop (entering
        and leaving it costs a few microseconds a call); a caller outside it gets it here."""
        if torch.is_inference_mode_enabled():
            return self._iterate(items)
        with torch.inference_mode():
            return self._iterate(items)

    def _iterate(self, items: list[WorkItem]) -> WorkerReport | None:
        t0 = time.monotonic()
        head = _cheap_head(items) if self.pacing.overlap else len(items)
        self.apply_all(merge_prefills(items[:head], self.max_prefill_tokens))
        t1 = time.monotonic()
        early = self._launch()
        t2 = time.monotonic()
        self.apply_all(merge_prefills(items[head:], self.max_prefill_tokens))
        t3 = time.monotonic()
        launches = early or self._launch()  # an idle worker runs what it was just given
        t4 = time.monotonic()
        while self.inflight and (not launches or len(self.inflight) > self.pacing.depth):
            self.collect(self.inflight.popleft())
        self.flow.join()
        report = self.report.take(self.idle)
        phases = self.phase_s
        phases[0] += (t1 - t0) + (t3 - t2)
        phases[1] += (t2 - t1) + (t4 - t3)
        phases[2] += time.monotonic() - t4
        return report

    def _launch(self) -> int:
        """Let the waiting requests join, then queue `multi_step` forwards over the layout if
        it has blocks; returns how many were launched."""
        self.flow.join()
        launches = self.pacing.multi_step if self.batch.num_rows else 0
        for _ in range(launches):
            self.inflight.append(self.launch())
        return launches

    # ---- changes from the scheduler -----------------------------------------------------

    def apply_all(self, items: list[WorkItem]) -> None:
        """Apply the items in order. Their page mappings reach the device together: before
        the first prefill after them, which writes through the page table, at once (one copy
        and one scatter, `add_pages_many`, after whatever the row storage holds staged); the
        others staged in the row storage's inbox, which the next denoise forward applies first
        thing (no device call of their own; written at once only where the storage has no
        room or no page table)."""
        pages: list[tuple[int, int, np.ndarray]] = []
        for item in items:
            if isinstance(item, AddPages):
                self.flow.map_pages(item.slot, item.first, len(item.pages), self.runner.page_size)
                pages.append((item.slot, item.first, item.pages))
                continue
            if isinstance(item, Prefill):
                self._map_now(pages)
                pages = []
            self.apply(item)
        if pages and not self.storage.stage_pages(pages):
            self._map_now(pages)

    def _map_now(self, pages: list[tuple[int, int, np.ndarray]]) -> None:
        """Page mappings written at once, after those staged earlier (which also land now: a
        prefill reads the page table outside any denoise forward)."""
        self.storage.apply_pages()
        if pages:
            self.runner.add_pages_many(pages)

    def apply(self, item: WorkItem) -> None:
        """One change other than AddPages (`apply_all` maps pages in batches)."""
        if isinstance(item, Prefill):
            self._trace("prefill", lambda: self.runner.prefill(item.slots, item.seg_starts,
                                                               item.token_ids),
                        sum(len(t) for t in item.token_ids))
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
        blocks = [Block(msg.first_start + i * self.k, init_ids=msg.blocks[i],  # (read only)
                        init_state=msg.states[i], init_steps=msg.block_steps[i])
                  for i in range(n)]
        self.flow.admit(DeviceReq(msg.uid, msg.slot, msg.settings,
                                  msg.first_start + n * self.k, blocks))

    def release(self, uid: int) -> None:
        req = self.flow.find(uid)
        if req is not None:
            self.flow.remove(req)

    def preempt(self, uid: int) -> None:
        req = self.flow.find(uid)
        if req is None:
            return
        blocks = list(req.blocks)  # a block still waiting for its predecessor holds nothing
        while blocks and self.batch.waiting(blocks[-1]):
            blocks.pop()
        ids, states = (self.batch.host_rows(blocks) if blocks
                       else (np.zeros((0, self.k), np.int64), []))
        self.report.preempted(Preempted(
            uid, req.first_start, ids, states, [self.batch.steps(b) - b.waited for b in blocks],
            self.batch.forwards(req)))
        self.flow.remove(req)

    def fail(self, req: DeviceReq, message: str) -> None:
        if req.alive:
            logger.error("request uid %d failed: %s", req.uid, message)
            self.report.failed(Failed(req.uid, message))
            self.flow.remove(req)

    # ---- the device -----------------------------------------------------------------------

    def launch(self) -> Launch:
        """Queue forward + step over the current layout; nothing waits for the device."""
        layout = self.batch.layout()
        if layout is not self.prepared:
            self.run = self._prepare(layout)
            self.prepared = layout
        self.storage.flush()  # the layout's row writes: applied first thing in the forward
        assert self.run is not None
        run = self.run
        gates_open = not self.batch.gated  # no row waits: the step skips the gates
        if run.step is not None and not layout.sampled:  # one graph: forward + step
            step = run.open_step if gates_open and run.open_step is not None else run.step
            readout, failed = self._trace("denoise", step, len(layout.rows)), []
        else:
            readout, failed = self._trace("denoise", lambda: denoise_step(
                self.algo, layout.batch, run.forward(), layout.state, self.spec,
                gates_open=gates_open), len(layout.rows))
        layout.steps += 1
        self.batch.launched()
        self.report.msg.forwards += 1
        self.report.msg.block_steps += len(layout.rows)
        return Launch(layout, layout.steps.copy(), self.readback.start(readout),
                      [layout.reqs[i] for i in failed], self.storage.fetches)

    def _prepare(self, layout: Layout) -> DenoiseRun:
        """The runner's run over the layout's rows: the one of its row count where the forward
        computes its metadata on the device from the storage rows (then the layout's host
        columns are never made), else one made from the columns."""
        n = len(layout.rows)
        run = self.runner.resident_run(n, layout.ids)
        if run is not None:
            return run
        c = layout.cols
        return self.runner.prepare_denoise(c.slots, c.first_starts, [1] * n, layout.ids)

    # ---- results --------------------------------------------------------------------------

    def collect(self, launch: Launch) -> None:
        """Read step k back: refresh the flags of the blocks it says something new about, fail
        what must fail, then retire and open blocks as the mode says."""
        t0 = time.monotonic()
        data = launch.readout.get()
        wait = time.monotonic() - t0
        self.storage.ran(launch.fetches)
        self.wait_s += wait
        self.pacing.observe(wait)
        for req in launch.failed:
            self.fail(req, "the decoding algorithm raised an error while stepping this request")
        rows, owners = launch.layout.rows, launch.layout.reqs
        for i in self._notable(launch, data):
            if rows[i].alive:
                self._refresh(rows[i], owners[i], data[i], int(launch.steps[i]))
        before = len(self.report.retired)
        self.flow.advance()
        if self.pacing.auto_depth and len(self.report.retired) > before:
            self.pacing.retired([b.final_step for _, b, _ in self.report.retired[before:]])

    def _notable(self, launch: Launch, data: np.ndarray) -> list[int]:
        """The rows a readout `data` (N, K + 6) says something new about: bad, at the step
        bound, or flags (converged, ready, gated) that differ from what the host knows of their
        blocks (refreshing any other live row changes nothing)."""
        k, rows, n = self.k, launch.layout.rows, len(launch.layout.rows)
        notable = (data[:, k + BAD] > 0) | (launch.steps >= self.max_steps)
        if self.mode.fdfo and not self.spec.wavefront and not self.gate:  # a block leaves on
            notable |= data[:, k + CONVERGED] > 0  # the readout that finds it converged
            return notable.nonzero()[0].tolist()  # (np.flatnonzero: twice the time)
        # blocks stay converged (sync waits for the batch, a wavefront retires in order); ready
        # reads 0 with W = 1, gated 0 where the host knows the row open (it opened before the
        # host cleared its gate): every flag compared in one pass over the rows
        seen = ((data[:, k + CONVERGED] > 0) + 2 * (data[:, k + READY] > 0)
                + 4 * (data[:, k + GATED] > 0))
        known = np.fromiter((b.converged + 2 * b.ready + 4 * (b.gate != 0) for b in rows),
                            np.int64, n)
        notable |= seen != known
        return notable.nonzero()[0].tolist()

    def _refresh(self, block: Block, req: DeviceReq, row: np.ndarray, steps: int) -> None:
        k = self.k
        if block.gate and not row[k + GATED]:  # the device opened it in this step
            self.batch.opened(block)
            block.waited = steps - 1
            if self.mode.fdfo:
                self.flow.flag(req)  # its request may place the next block behind it
        steps -= block.waited  # its own steps
        converged = bool(row[k + CONVERGED])
        if converged and not block.converged:  # its final forward is the one after this step
            block.final_step = steps + 1
            block.ids, block.edits = row[:k].copy(), int(row[k + EDITS])
        block.converged = converged
        block.ready = bool(row[k + READY])  # a waiting (gated) row reads 0
        if (converged or block.ready) and self.mode.fdfo:
            self.flow.flag(req)
        if row[k + BAD]:
            self.fail(req, "the model produced non-finite logits for this request")
        elif not block.converged and not block.gate and steps >= self.max_steps:
            self.fail(req, f"a block did not converge within {self.max_steps} steps")

    # ---- reports ------------------------------------------------------------------------

    def _trace(self, kind: str, fn, rows: int = 0):  # type: ignore[no-untyped-def]
        return fn() if self.tracer is None else self.tracer.run(kind, fn, rows)

    def _graph_step(self, bucket: int, logits: Scores, gates_open: bool = False) -> torch.Tensor:
        """The greedy step over storage rows [0, bucket), as captured after the forward
        (gates_open: the gated storage's step for when no row waits)."""
        _, state = self.storage.views(bucket)
        readout, _ = denoise_step(self.algo, self.storage.graph_batch(bucket), logits, state,
                                  self.spec, isolate=False, gates_open=gates_open)
        return readout


def _cheap_head(items: list[WorkItem]) -> int:
    """How many of the items, from the first, are cheap to apply before the launch: AddPages,
    Admit, Release (never past a Prefill or Preempt: the items keep their order, since a slot
    that a Release frees may be mapped again right after it, and an Admit after a Prefill needs
    that prefill launched first)."""
    n = 0
    while n < len(items) and isinstance(items[n], AddPages | Admit | Release):
        n += 1
    return n
