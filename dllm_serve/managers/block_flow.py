"""`BlockFlow`: which blocks leave the worker's batch and which join it after each readout.

The worker (managers/worker.py) reads step k back and refreshes what it learnt on its blocks
(`Block.converged`, `ready`); then `advance` retires blocks and opens the next ones as the mode
says (dllm/modes.py: FDFO plans each request on its own, `plan_one`; sync the batch, `plan`),
and `join` lets admitted requests in. Requests are in one of three
places: `waiting` (admitted, not yet in the batch: FDFO joins them at the next launch, sync at a
batch boundary, either while the batch holds fewer than max_requests), the batch
(`ResidentBatch`), or `parked` (in the batch without a block: the pages of their next block are
not mapped yet). Retired blocks go to the report (`ReportBuilder`);
a request whose block holds a stop token or reaches its max_end is dropped (the scheduler
finishes it on the report).

Gated mode (`RoundMode.gate`: W > 1, or W = 1 with standby and FDFO): while *armed*, whenever a
request's window has room behind an open frontier (and the pages are mapped), the host places the
next block there at once, gated, and the device opens it (dllm/wavefront.py). A request holds at
most one gated block, its last; a frontier with a gated block behind it never spawns on the host
(the gated block fills the window, and its readiness reads 0 while it waits). Armed: the retired
blocks' forwards, averaged with weight ARM_WEIGHT each, are at most `arm_forwards` (it starts
at 0: armed). Disarmed, blocks open as without gating: a waiting row costs a row of every forward
it waits, which blocks of many forwards pay for many times over the one forward it saves.
"""

from __future__ import annotations

from itertools import islice
from operator import attrgetter

from dllm_serve.dllm.modes import RoundMode, plan, plan_one
from dllm_serve.managers.batch_layout import Block, DeviceReq
from dllm_serve.managers.resident_batch import ResidentBatch
from dllm_serve.managers.worker_report import ReportBuilder

ARM_WEIGHT = 1 / 16  # a retired block's weight in the average that arms gated placement


class BlockFlow:
    def __init__(self, batch: ResidentBatch, report: ReportBuilder, mode: RoundMode,
                 block_size: int, max_requests: int) -> None:
        """max_requests: most requests in the batch at once; admitted ones past it wait (the
        scheduler admits some ahead, so that they join as soon as a request leaves)."""
        self.batch, self.report, self.mode, self.k = batch, report, mode, block_size
        self.max_requests = max_requests
        self.gate = mode.gate  # gated mode: the flags a placed block waits for (0: off)
        self.arm_forwards = mode.wavefront.arm_forwards  # inf: always armed
        self.block_forwards = 0.0  # retired blocks' forwards, a moving average
        self.window = mode.rows_per_request  # most blocks a request holds, a gated one too
        self.spawn_below = mode.wavefront.size  # a ready frontier spawns behind it below W
        self.mapped: dict[int, int] = {}  # slot -> end of its mapped pages (tokens)
        # admitted, joining at once (sync: at a boundary), by uid in admission order (a
        # Release finds one here, or learns it is gone, without a scan)
        self.waiting: dict[int, DeviceReq] = {}
        self.parked: list[DeviceReq] = []  # no block open: waiting for their pages
        # FDFO: every live request with a converged leftmost block or a ready frontier
        # (advance's candidates) is here, by id: a refresh that flags one of its blocks adds it
        # (`flag`), advance keeps those it leaves candidates (only a refresh or advance can make
        # a request one: blocks are opened and admitted unflagged)
        self.flagged: dict[int, DeviceReq] = {}
        # sync: an advance since the last join retired the whole batch (it stays set until
        # join lets the waiting requests in: several readouts may be collected in between)
        self.boundary = True

    # ---- the scheduler's changes --------------------------------------------------------

    def map_pages(self, slot: int, first: int, count: int, page_size: int) -> None:
        """Pages [first, first + count) of the slot are mapped (first 0: a fresh mapping)."""
        base = 0 if first == 0 else self.mapped.get(slot, 0)
        self.mapped[slot] = max(base, (first + count) * page_size)

    def admit(self, req: DeviceReq) -> None:
        self.waiting[req.uid] = req

    def find(self, uid: int) -> DeviceReq | None:
        return self.batch.reqs.get(uid) or self.waiting.get(uid)

    def remove(self, req: DeviceReq) -> None:
        if self.waiting.get(req.uid) is req:
            del self.waiting[req.uid]
            req.alive = False
        else:
            self.batch.drop(req)

    @property
    def joinable(self) -> bool:
        """Some admitted request waits and the batch has room for it."""
        return bool(self.waiting) and len(self.batch.reqs) < self.max_requests

    def flag(self, req: DeviceReq) -> None:
        """FDFO: a refresh found one of the request's blocks converged or ready."""
        self.flagged[id(req)] = req

    # ---- after each readout ---------------------------------------------------------------

    def advance(self) -> None:
        """Retire and open blocks. Only requests where something can happen are planned: a
        converged leftmost block, a ready frontier, or (sync) a batch that is all done."""
        any_active = self.batch.num_rows > 0  # some request has a block
        if self.mode.fdfo:  # after every forward: only the flagged requests (admission order)
            cands = sorted((r for r in self.flagged.values() if r.alive and self._candidate(r)),
                           key=attrgetter("seq"))
            done = False
        else:
            active = [r for r in self.batch.reqs.values() if r.blocks]
            done = bool(active) and all(r.blocks[0].converged for r in active)
            cands = active if done else [r for r in active if self._spawns(r)
                                         or (self.placing and self._has_room(r))]
        if not cands:
            self.flagged.clear()
            self.boundary |= not any_active
            return
        reported = len(self.report.retired)
        boundary = False
        if self.mode.fdfo:  # requests on their own: each planned, then changed, in turn
            for req in cands:
                self._change(req, *plan_one(self.mode, _leading(req.blocks), len(req.blocks),
                                            req.blocks[-1].ready, self._can_open(req)))
            self.flagged = {id(r): r for r in cands if r.alive and self._candidate(r)}
        else:  # sync: plan's inputs, one per candidate: leading converged blocks, blocks, a
            # ready frontier (a gated frontier reads False), room after it
            p = plan(self.mode, [_leading(r.blocks) for r in cands],
                     [len(r.blocks) for r in cands], [r.blocks[-1].ready for r in cands],
                     [self._can_open(r) for r in cands], done)
            for req, count, opens in zip(cands, p.retire, p.open, strict=True):
                self._change(req, count, opens)
            boundary = p.boundary
        if len(self.report.retired) > reported:  # a round: some block retired
            self.report.msg.rounds += 1
        self.boundary |= boundary or not any_active

    def _change(self, req: DeviceReq, retire: int, opens: bool) -> None:
        """Retire the request's `retire` leading blocks, then (if it goes on) open its next
        block (`opens`), park it (no block left, its pages not mapped yet) or place one ahead
        (gated mode)."""
        if retire and not self._retire(req, retire):
            return
        if opens:
            self.batch.open_block(req)
        elif not req.blocks:
            self.parked.append(req)  # its next block's pages are not mapped yet
        self._place(req)

    def join(self) -> None:
        """Admitted requests join (in admission order, while the batch holds fewer than
        max_requests), and requests without a block (pages were missing) open one: at once
        with FDFO; with sync at a batch boundary or when the batch is empty."""
        if not (self.mode.fdfo or self.boundary or self.batch.num_rows == 0):
            return
        room = self.max_requests - len(self.batch.reqs)
        if self.waiting and room > 0:
            joining = list(islice(self.waiting.values(), room))
            for req in joining:
                del self.waiting[req.uid]
                self.batch.add(req)
                self._place(req)
        parked, self.parked = self.parked, []
        for req in parked:
            if req.alive and not req.blocks and self._can_open(req):
                self.batch.open_block(req)
                self._place(req)
            elif req.alive and not req.blocks:
                self.parked.append(req)
        self.boundary = False

    def _retire(self, req: DeviceReq, count: int) -> bool:
        """Retire and report the request's leading blocks; False if it is over (a stop token
        or max_end: the worker forgets it, the scheduler finishes it on the report)."""
        forwards = self.batch.forwards(req)
        for block in self.batch.retire(req, count):
            self.report.msg.idle_block_steps += (self.batch.steps(block) - block.waited
                                                 - block.final_step)
            self.block_forwards += ARM_WEIGHT * (block.final_step - self.block_forwards)
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
        if not req.stops or block.ids is None:
            return False
        gen = block.ids[max(0, s.prompt_len - block.start):]
        return not req.stops.isdisjoint(gen.tolist())  # (a set: 4x numpy's compare here)

    @property
    def placing(self) -> bool:
        """Gated mode and armed: blocks are placed ahead."""
        return self.gate != 0 and self.block_forwards <= self.arm_forwards

    def _place(self, req: DeviceReq) -> None:
        """Gated mode, armed: place the request's next block behind its open frontier, gated,
        if its window has room and the block fits."""
        if self.placing and req.alive and self._has_room(req) and self._can_open(req):
            self.batch.open_block(req, self.gate)

    def _has_room(self, req: DeviceReq) -> bool:
        return bool(req.blocks) and not req.blocks[-1].gate and len(req.blocks) < self.window

    def _candidate(self, req: DeviceReq) -> bool:
        """Something can happen to the request in advance: its leftmost block converged, its
        frontier is ready with room behind it in the wavefront (plan's spawn: fewer than W
        blocks; a ready frontier in a full window waits for the leftmost block, whose
        convergence flags the request again), or (gated) a block may be placed behind its
        frontier. A request kept flagged for nothing is planned again after every forward."""
        blocks = req.blocks
        return bool(blocks) and (blocks[0].converged or self._spawns(req)
                                 or (self.placing and self._has_room(req)))

    def _spawns(self, req: DeviceReq) -> bool:
        """Its frontier is ready with room behind it: plan may open the next block (FDFO and
        sync alike; the request has a block)."""
        return req.blocks[-1].ready and len(req.blocks) < self.spawn_below

    def _can_open(self, req: DeviceReq) -> bool:
        end = req.next_start + self.k
        return end <= req.settings.max_end and end <= self.mapped.get(req.slot, 0)


def _leading(blocks: list[Block]) -> int:
    """Converged blocks at the start of a window."""
    n = 0
    while n < len(blocks) and blocks[n].converged:
        n += 1
    return n
