"""`ResidentBatch`: the worker's running batch, kept on the device across forwards.

It holds every admitted request (`DeviceReq`: slot, settings) and its active blocks (`Block`),
and their device tensors: ids (N, K) and the algorithm's state (N, ...) in rows [0, N) of the
worker's `RowStorage`. Layout invariant: every row holds one block, its own segment of the
forward (a request's blocks need not be in adjacent rows: each block attends to the cache, where
the forward stores every block's K/V before any attention, so a block sees its request's earlier
blocks wherever they are), or a *hole* (a pad block: the runner's scratch slot, positions [0, K),
its readout ignored). `Layout.reqs` lists each row's request; the step groups a request's rows by
its key (row_req: its slot). A block that stays is never re-sent, re-uploaded or copied to the
host. When the set of blocks changes, `layout()` *patches* the layout: a block that left
(retired, dropped) leaves a hole, a new block (a request's next block, a wavefront's spawned
block, a joining request's) takes a hole or appends a row. Holes that would cost (a larger
bucket than the blocks need, more than a quarter of the rows, or any compute at all on an
unpadded runner) are then closed by *moves*: the last live rows take the first holes, so the
blocks fill rows [0, N) again. Only the changed rows are written
(RowStorage's staged writes, one message to the device; a moved row's ids and state are copied on
the device from its old row), and the patch looks only at what changed since the last layout
(`touched`: requests added, dropped, with a block retired or opened; `gone`: the blocks that
left); the layout's per-row host `Columns` (slots, starts, sampling settings), which only
an eager forward or a sampling step reads, are made when first asked for, as a copy of the
previous layout's with only the changed rows rewritten: its Python work grows with the
changes, not with the batch. Whether any row samples is a count (`sampling`: requests in the
layout with a temperature above 0), not a look at the columns.
Per-forward bookkeeping is O(1) in Python: each layout counts its rows' steps in one numpy
array (`Layout.steps`, also the batch's `block_steps`; a moved row's count moves with it), and
the batch counts its forwards in one counter (`launches`): a request's
forwards are those it was in the layout for (`forwards`), folded into it when it leaves.
The host keeps per block what it has read back (`Block.converged`, `ready`, `ids`, and for a
block placed gated, `gate` until a readout says the device opened it: dllm/wavefront.py; a
gated block holds a row like any other, its gate in the storage's `gate` column; `gated`
counts the live ones: while it is 0 no row can wait, and the worker's step skips the gates). The
records (`Block`, `DeviceReq`, `Layout`, `Columns`) are in managers/batch_layout.py.
"""

from __future__ import annotations

import numpy as np

from dllm_serve.dllm.algorithms.base import DllmAlgorithm
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.managers.batch_layout import (
    HOLE_SETTINGS,
    Block,
    Columns,
    DeviceReq,
    Layout,
)
from dllm_serve.managers.messages import RowState
from dllm_serve.managers.row_storage import RowStorage
from dllm_serve.model.buckets import denoise_buckets, pick_bucket


class ResidentBatch:
    def __init__(self, algo: DllmAlgorithm, storage: RowStorage, scratch_slot: int,
                 padded: bool) -> None:
        """scratch_slot: the runner's request slot whose page takes pad blocks' K/V (holes).
        padded: the runner pads forwards to buckets (a hole within the bucket is free); an
        unpadded (eager) runner computes every row, so holes are never kept there."""
        self.algo = algo
        self.storage = storage
        self.scratch_slot = scratch_slot
        # the placeholder request of every hole's row (a pad block: scratch slot, [0, K))
        self.hole = DeviceReq(-1, scratch_slot, HOLE_SETTINGS, 0, [Block(0, alive=False)],
                              alive=False, hole=True)
        # what a forward of N rows costs: its bucket; None: no holes
        self.buckets = denoise_buckets(storage.capacity) if padded else None
        self.device = storage.device
        self.k = storage.k
        self.mask_row = np.full(self.k, algo.mask_id, dtype=np.int64)  # every opened block's
        self.mask_row.flags.writeable = False  # init_ids: shared, so never written
        self.reqs: dict[int, DeviceReq] = {}  # admission order
        self.current: Layout | None = None  # the layout of the device tensors
        self.dirty = False
        self.num_rows = 0
        self.launches = 0  # forwards run over any layout
        # since the last layout: the requests changed (in order of change) and
        # the blocks that left (retired, dropped); a patch looks at these only
        self.touched: dict[int, DeviceReq] = {}
        self.gone: list[Block] = []
        self.admitted = 0  # requests added so far (DeviceReq.seq)
        self.sampling = 0  # requests in the layout that sample (temperature > 0)
        self.gated = 0  # live blocks placed gated that no readout has shown open yet

    # ---- membership ---------------------------------------------------------------------

    def add(self, req: DeviceReq) -> None:
        self.reqs[req.uid] = req
        req.seq, self.admitted = self.admitted, self.admitted + 1
        self.num_rows += len(req.blocks)
        self._touch(req)

    def drop(self, req: DeviceReq) -> None:
        """Remove the request and its blocks (they are never reported)."""
        req.alive = False
        for block in req.blocks:
            block.alive = False
            self.gated -= block.gate != 0
        self.gone += req.blocks
        if self.reqs.pop(req.uid, None) is not None:
            self.num_rows -= len(req.blocks)
        self._touch(req)

    def open_block(self, req: DeviceReq, gate: int = 0) -> None:
        """Append an all-mask block at req.next_start (fresh state; its init_ids the batch's
        one read-only mask row), gated on its predecessor's flags `gate` (0: open)."""
        req.blocks.append(Block(req.next_start, init_ids=self.mask_row, gate=gate))
        self.gated += gate != 0
        req.next_start += self.k
        self.num_rows += 1
        self._touch(req)

    def opened(self, block: Block) -> None:
        """A readout showed the gated block open (the device opened it in that step)."""
        assert block.gate
        block.gate = 0
        self.gated -= 1

    def retire(self, req: DeviceReq, count: int) -> list[Block]:
        """Remove the request's `count` leading blocks (their final forward has run)."""
        gone, req.blocks = req.blocks[:count], req.blocks[count:]
        for block in gone:
            block.alive = False
            self.gated -= block.gate != 0
        self.num_rows -= len(gone)
        if gone:
            self.gone += gone
            self._touch(req)
        return gone

    def _touch(self, req: DeviceReq) -> None:
        self.touched[id(req)] = req  # not by uid: a preempted request may come back as another
        self.dirty = True

    def steps(self, block: Block) -> int:
        """Forwards the block has had."""
        cur = self.current
        if block.row >= 0 and cur is not None:
            return int(cur.steps[block.row])
        return block.init_steps

    def forwards(self, req: DeviceReq) -> int:
        """Denoise forwards the request has taken part in."""
        return req.past_forwards + (self.launches - req.entered_at if req.in_layout else 0)

    def launched(self) -> None:
        """A forward over the current layout was queued."""
        self.launches += 1

    def _enter(self, req: DeviceReq) -> None:
        if not req.in_layout:
            req.in_layout, req.entered_at = True, self.launches
            self.sampling += req.settings.temperature > 0

    def _leave(self, req: DeviceReq) -> None:
        if req.in_layout:
            req.past_forwards += self.launches - req.entered_at
            req.in_layout = False
            self.sampling -= req.settings.temperature > 0

    # ---- the device tensors -------------------------------------------------------------

    def layout(self) -> Layout:
        """The current layout, rebuilt (rows gathered, new blocks appended) if anything
        changed since the last call."""
        if self.dirty or self.current is None:
            self.current = self._rebuild()
            self.dirty = False
            self.touched, self.gone = {}, []
        return self.current

    def _rebuild(self) -> Layout:
        """The new layout from the current one (see the module docstring): blocks that left
        leave holes, new blocks take holes (lowest first) or append rows, then holes that would
        cost (a larger bucket than the blocks need, more than a quarter of the rows, or any
        compute at all on an unpadded runner) are closed by moving the last rows into them.
        Only what changed since the last layout is looked at."""
        if self.num_rows > self.storage.capacity:
            raise RuntimeError(f"{self.num_rows} active blocks exceed the worker's row storage "
                               f"({self.storage.capacity})")
        old = self.current if self.current is not None else self._empty()
        leaving = [b.row for b in self.gone if b.row >= 0]
        entrants = [(r, b) for r in self.touched.values() if r.alive and not r.hole
                    for b in r.blocks if b.row < 0]
        entrants.sort(key=lambda e: (e[0].seq, e[1].start))
        reqs, rows = list(old.reqs), list(old.rows)
        hole = self.hole
        for i in leaving:
            reqs[i], rows[i] = hole, hole.blocks[0]
        holes = sorted(old.holes + leaving)
        placed: list[int] = []  # the entrants' rows
        for r, b in entrants:
            i = holes.pop(0) if holes else len(rows)
            if i < len(rows):
                reqs[i], rows[i] = r, b
            else:
                reqs.append(r)
                rows.append(b)
            placed.append(i)
        steps = np.zeros(len(rows), dtype=np.int64)
        steps[:len(old.rows)] = old.steps
        steps[placed] = [b.init_steps for _, b in entrants]
        targets: list[int] = []
        sources: list[int] = []
        n = len(rows)
        if self._costly(n, len(holes)):  # close the holes: the last live rows move into them
            n -= len(holes)
            sources = [i for i in range(n, len(rows)) if not reqs[i].hole]
            targets, holes = [h for h in holes if h < n], []
            for t, src in zip(targets, sources, strict=True):
                reqs[t], rows[t], steps[t] = reqs[src], rows[src], steps[src]
        del reqs[n:], rows[n:]
        steps = steps[:n]
        # rows that now hold no request get a hole's metadata (no request key), unless they
        # already did; then the layout's bookkeeping
        freed = sorted(i for i in {*leaving, *sources}
                       if i >= len(rows) or reqs[i] is hole)
        self._stage(placed, entrants, targets, sources, freed, reqs, rows)
        self._bookkeep(old, entrants, rows, placed, targets)
        ids, state = self.storage.views(len(rows))
        return Layout(reqs, rows, steps, ids, state, holes, self.sampling > 0, self._batch,
                      old._cols, leaving + placed + targets)

    def _costly(self, total: int, holes: int) -> bool:
        """Whether `holes` of `total` rows cost enough to close: a larger bucket than the
        blocks need, more than a quarter of the rows, or any compute at all (unpadded)."""
        if not holes:
            return False
        if self.buckets is None or holes > total // 4:
            return True
        return pick_bucket(total, self.buckets) != pick_bucket(total - holes, self.buckets)

    def _stage(self, placed: list[int], entrants: list[tuple[DeviceReq, Block]],
               targets: list[int], sources: list[int], freed: list[int],
               reqs: list[DeviceReq], rows: list[Block]) -> None:
        """Stage the changed rows in the storage: the entrants' (ids, fresh state, metadata),
        the moved rows' (their source's ids and state, their metadata), the freed rows' (a
        hole's metadata: no request key, so a hole never groups with a request that reuses its
        slot)."""
        blocks = [b for _, b in entrants]
        owners = [r for r, _ in entrants] + [reqs[t] for t in targets]
        starts = [b.start for b in blocks] + [rows[t].start for t in targets] + [0] * len(freed)
        owners += [self.hole] * len(freed)
        self.storage.write_rows(
            np.asarray(placed + targets + freed, dtype=np.int64), _init_ids(blocks),
            [b.init_state for b in blocks], np.asarray(starts, dtype=np.int64),
            np.fromiter((r.slot for r in owners), np.int64, len(owners)),
            np.fromiter((r.settings.seed for r in owners), np.int64, len(owners)),
            sources=np.asarray(sources, dtype=np.int64),
            gates=(np.fromiter((b.gate for b in blocks), np.int64, len(blocks))
                   if self.storage.gate is not None else None))

    def _bookkeep(self, old: Layout, entrants: list[tuple[DeviceReq, Block]],
                  rows: list[Block], placed: list[int], targets: list[int]) -> None:
        """Blocks learn their rows; requests enter and leave the layout (forward counts); new
        requests' params are written."""
        for b in self.gone:
            b.row = -1
        for i, (_, b) in zip(placed, entrants, strict=True):
            b.row, b.init_ids, b.init_state = i, None, None
        for t in targets:
            rows[t].row = t
        newcomers = list({id(r): r for r, _ in entrants if not r.in_layout}.values())
        for r in self.touched.values():
            if r.in_layout and not (r.alive and r.blocks):
                self._leave(r)
        for r in newcomers:
            self._enter(r)
        if newcomers and self.algo.request_params:
            self.storage.write_params(np.asarray([r.slot for r in newcomers], dtype=np.int64),
                                      self._params(newcomers))

    def _empty(self) -> Layout:
        ids, state = self.storage.views(0)
        return Layout([], [], np.zeros(0, dtype=np.int64), ids, state, [], False, self._batch,
                      Columns.of([], []))

    def _batch(self, cols: Columns, steps: np.ndarray) -> DenoiseBatch:
        """The DenoiseBatch of rows [0, N) laid out as `cols` says (it shares their lists:
        a later patch copies them before it changes anything)."""
        n = len(cols.slots)
        ids, _ = self.storage.views(n)
        batch = DenoiseBatch(
            block_ids=ids, num_blocks=[1] * n, first_starts=cols.first_starts,
            temperatures=cols.temperatures, top_ps=cols.top_ps, seeds=cols.seeds,
            params=self.storage.req_params, block_steps=steps, top_ks=cols.top_ks,
            min_ps=cols.min_ps)
        batch.bind_rows(*self.storage.row_views(n))
        batch.gates = self.storage.gate_views(n)
        return batch

    def _params(self, reqs: list[DeviceReq]) -> np.ndarray:
        """(P, B) per-request values of the algorithm's request_params (defaults where unset)."""
        defaults = zip(self.algo.request_params, self.storage.defaults.tolist(), strict=True)
        return np.array([[r.settings.params.get(name, d) for r in reqs] for name, d in defaults],
                        dtype=np.float32)

    def waiting(self, block: Block) -> bool:
        """Whether the block still waits for its predecessor on the device now (a host sync
        if it is on the device and the host has not read it open)."""
        gate = self.storage.gate
        if not block.gate or block.row < 0 or gate is None:
            return bool(block.gate)
        return bool(gate[block.row].item())

    def host_rows(self, blocks: list[Block]) -> tuple[np.ndarray, list[RowState | None]]:
        """The blocks as they are on the device now (a host sync): ids (n, K) and per-block
        states. Blocks not yet on the device come from their init values."""
        cur = self.current
        ids, states = [], []
        for b in blocks:
            if b.row >= 0 and cur is not None:
                ids.append(cur.batch.block_ids[b.row].cpu().numpy())
                states.append(None if cur.state is None else
                              {k: v[b.row].cpu().numpy() for k, v in cur.state.items()})
            else:
                ids.append(np.asarray(b.init_ids))
                states.append(b.init_state)
        return np.stack(ids), states


def _init_ids(blocks: list[Block]) -> np.ndarray:
    """(M, K) int64: the blocks' ids before they are on the device."""
    if not blocks:
        return np.zeros((0, 0), np.int64)
    return np.array([b.init_ids for b in blocks], dtype=np.int64)  # (np.stack: 3x the time)
