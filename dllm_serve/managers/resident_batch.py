"""`ResidentBatch`: the worker's running batch, kept on the device across forwards.

It holds every admitted request (`DeviceReq`: slot, settings) and its active blocks (`Block`),
and their device tensors: ids (N, K) and the algorithm's state (N, ...) in rows [0, N) of the
worker's `RowStorage`. Layout invariant: the rows are grouped by *position* (one request, or a
hole), a request's blocks in consecutive rows in block order; `Layout.reqs` lists the positions
in row order, so the forward's segments are exactly the rows in order. A block that stays is
never re-sent, re-uploaded or copied to the host. When the set of blocks changes, `layout()`
first tries a *patch*, which moves no row: a request's finished block is replaced by its next
one in the same row, a request that leaves (or has no block open) leaves a *hole* (a position
whose one row is a pad block: the runner's scratch slot, positions [0, K), its readout ignored),
and a request that joins with one block takes a hole or appends a row; only the changed rows
are written (one host-to-device copy). When that cannot be done (a request's block count
changed: the wavefront; holes would cost a larger bucket or a quarter of the rows, or any
compute at all on an unpadded runner; more rows than the storage holds) `compact` gathers the
surviving rows, appends the new blocks' ids and fresh state and writes them back to rows
[0, N) without holes, in admission order.
A patch looks only at the requests changed since the last layout (`touched`: added, dropped,
a block retired or opened) and copies the layout's per-position `Columns` (slots, starts,
sampling settings), rewriting only the changed positions: its Python work grows with the
changes, not with the batch.
Per-forward bookkeeping is O(1) in Python: each layout counts its rows' steps in one numpy
array (`Layout.steps`, also the batch's `block_steps`), folded back into the blocks when the
layout is replaced, and the batch counts its forwards in one counter (`launches`): a request's
forwards are those it was in the layout for (`forwards`), folded into it when it leaves.
The host keeps per block what it has read back (`Block.converged`, `ready`, `ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.managers.messages import ReqSettings, RowState
from dllm_serve.managers.row_storage import RowStorage
from dllm_serve.model.buckets import denoise_buckets, pick_bucket
from dllm_serve.utils.device import to_device


@dataclass(eq=False)
class Block:
    """One active block. init_*: its ids, state and step count until it is on the device."""

    start: int
    init_ids: np.ndarray | None = None  # (K,)
    init_state: RowState | None = None
    init_steps: int = 0
    row: int = -1  # its row in the current layout, -1 before it is on the device
    final_step: int = 0  # steps at its final (done-on-entry) forward; 0 until known
    alive: bool = True
    converged: bool = False  # read back: the next forward is its final one
    ready: bool = False  # read back: the wavefront may open the block after it
    ids: np.ndarray | None = None  # (K,) read back after a step that found it converged
    edits: int = 0


HOLE_SETTINGS = ReqSettings(prompt_len=0, max_end=0)  # greedy, defaults: what a hole steps with


@dataclass(eq=False)
class DeviceReq:
    uid: int
    slot: int
    settings: ReqSettings
    next_start: int  # where its next block opens (the end of its blocks)
    blocks: list[Block] = field(default_factory=list)
    past_forwards: int = 0  # forwards it took part in before it last entered the layout
    in_layout: bool = False  # it has rows in the current layout
    entered_at: int = 0  # the batch's launch count when it entered the layout
    alive: bool = True
    hole: bool = False  # a hole's placeholder (see the module docstring), never a request
    pos: int = -1  # its position in the current layout (while in_layout)
    seq: int = 0  # admission order (ResidentBatch.add)

    @property
    def first_start(self) -> int:
        return self.blocks[0].start if self.blocks else self.next_start


@dataclass
class Columns:
    """Per position of a layout (B of them, host lists): what the forward and the step read of
    its request. A patch copies them and rewrites only the positions that changed."""

    slots: list[int]
    first_starts: list[int]
    counts: list[int]
    offsets: list[int]  # (B + 1,) first row of each position, then the row count
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int]
    top_ks: list[int]
    min_ps: list[float]

    @staticmethod
    def of(reqs: list[DeviceReq]) -> Columns:
        counts = [len(r.blocks) for r in reqs]
        return Columns([r.slot for r in reqs], [r.first_start for r in reqs], counts,
                       np.cumsum([0, *counts]).tolist(),
                       *([getattr(r.settings, n) for r in reqs] for _, n in SETTING_COLUMNS))

    def copy(self) -> Columns:
        return Columns(*(list(getattr(self, f)) for f in COLUMN_FIELDS))

    def set(self, pos: int, req: DeviceReq) -> None:
        """Position pos (its block count unchanged) := req."""
        self.slots[pos], self.first_starts[pos] = req.slot, req.first_start
        for column, name in SETTING_COLUMNS:
            getattr(self, column)[pos] = getattr(req.settings, name)

    def append(self, req: DeviceReq) -> None:
        """A new last position: req, with one block."""
        self.slots.append(req.slot)
        self.first_starts.append(req.first_start)
        self.counts.append(1)
        self.offsets.append(self.offsets[-1] + 1)
        for column, name in SETTING_COLUMNS:
            getattr(self, column).append(getattr(req.settings, name))


SETTING_COLUMNS = (("temperatures", "temperature"), ("top_ps", "top_p"), ("seeds", "seed"),
                   ("top_ks", "top_k"), ("min_ps", "min_p"))
COLUMN_FIELDS = ("slots", "first_starts", "counts", "offsets", "temperatures", "top_ps",
                 "seeds", "top_ks", "min_ps")


@dataclass
class Layout:
    """The rows of the device tensors: blocks in row order and the requests that own them;
    steps (N,) forwards each row has had (the batch's block_steps). Invariant:
    reqs[i].pos == i for every real request, and holes lists (ascending) the positions held by
    a hole."""

    reqs: list[DeviceReq]
    rows: list[Block]
    owners: list[DeviceReq]  # the request of each row
    batch: DenoiseBatch
    state: State | None
    cols: Columns
    holes: list[int]

    @property
    def steps(self) -> np.ndarray:
        return self.batch.block_steps


class ResidentBatch:
    def __init__(self, algo: DllmAlgorithm, storage: RowStorage, scratch_slot: int,
                 padded: bool) -> None:
        """scratch_slot: the runner's request slot whose page takes pad blocks' K/V (holes).
        padded: the runner pads forwards to buckets (a hole within the bucket is free); an
        unpadded (eager) runner computes every row, so holes are never kept there."""
        self.algo = algo
        self.storage = storage
        self.scratch_slot = scratch_slot
        # what a forward of N rows costs: its bucket; None: no holes
        self.buckets = denoise_buckets(storage.capacity) if padded else None
        self.device = storage.device
        self.k = storage.k
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
        self.gone += req.blocks
        if self.reqs.pop(req.uid, None) is not None:
            self.num_rows -= len(req.blocks)
        self._touch(req)

    def open_block(self, req: DeviceReq) -> None:
        """Append an all-mask block at req.next_start (fresh state)."""
        mask = np.full(self.k, self.algo.mask_id, dtype=np.int64)
        req.blocks.append(Block(req.next_start, init_ids=mask))
        req.next_start += self.k
        self.num_rows += 1
        self._touch(req)

    def retire(self, req: DeviceReq, count: int) -> list[Block]:
        """Remove the request's `count` leading blocks (their final forward has run)."""
        gone, req.blocks = req.blocks[:count], req.blocks[count:]
        for block in gone:
            block.alive = False
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

    def _leave(self, req: DeviceReq) -> None:
        if req.in_layout:
            req.past_forwards += self.launches - req.entered_at
            req.in_layout = False

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
        old = self.current
        patched = None if old is None else self._patch(old)
        return patched if patched is not None else self._compact(old)

    def _compact(self, old: Layout | None) -> Layout:
        """Every request with blocks, in admission order, rows gathered to [0, N), no holes."""
        reqs = [r for r in self.reqs.values() if r.blocks]
        rows = [b for r in reqs for b in r.blocks]
        if len(rows) > self.storage.capacity:
            raise RuntimeError(f"{len(rows)} active blocks exceed the worker's row storage "
                               f"({self.storage.capacity})")
        n_old = len(old.rows) if old is not None else 0
        index = np.fromiter((b.row for b in rows), np.int64, len(rows))  # old row, -1: fresh
        is_fresh = index < 0
        fresh = [b for b in rows if b.row < 0]
        steps = np.empty(len(rows), dtype=np.int64)
        kept = ~is_fresh
        if old is not None:
            steps[kept] = old.steps[index[kept]]
        steps[is_fresh] = [b.init_steps for b in fresh]
        index[is_fresh] = n_old + np.arange(len(fresh))
        self.storage.write(*self._gather(old, fresh, index))
        self._retire_layout(old)
        for i, b in enumerate(rows):
            b.row, b.init_ids, b.init_state = i, None, None
        for r in set(old.reqs if old is not None else ()) - set(reqs):
            self._leave(r)
        for r in reqs:
            self._enter(r)
        cols = Columns.of(reqs)
        self.storage.write_rows(np.arange(len(rows)), None, None,
                                np.fromiter((b.start for b in rows), np.int64, len(rows)),
                                np.repeat(np.arange(len(reqs)), cols.counts),
                                np.repeat(np.asarray(cols.seeds, dtype=np.int64), cols.counts))
        self.storage.write_params(np.arange(len(reqs)), self._params(reqs), len(rows),
                                  len(reqs))
        owners = [r for r in reqs for _ in r.blocks]
        for i, r in enumerate(reqs):
            r.pos = i
        return Layout(reqs, rows, owners, self._batch(cols, steps),
                      self.storage.views(len(rows))[1], cols, [])

    def _patch(self, old: Layout) -> Layout | None:
        """The new layout without moving a row (see the module docstring), or None when it
        cannot be had that way. Only the requests changed since `old` are looked at; nothing
        is changed before the answer is known."""
        counts, offsets = old.cols.counts, old.cols.offsets
        fresh: list[tuple[int, int, Block]] = []  # (row, position, block) written now
        leaving: list[int] = []  # positions that become holes
        staying: list[DeviceReq] = []  # changed requests that keep their position
        entrants: list[DeviceReq] = []
        for r in self.touched.values():
            if r.in_layout:
                p, n = r.pos, counts[r.pos]
                if not (r.alive and r.blocks):
                    if n != 1:
                        return None
                    leaving.append(p)
                elif len(r.blocks) != n:
                    return None
                else:
                    first = offsets[p]
                    for j, b in enumerate(r.blocks):
                        if b.row < 0:
                            fresh.append((first + j, p, b))
                        elif b.row != first + j:
                            return None
                    staying.append(r)
            elif r.alive and r.blocks:
                if len(r.blocks) != 1:
                    return None
                entrants.append(r)
        entrants.sort(key=lambda r: r.seq)
        holes = sorted(old.holes + leaving)
        appended = max(0, len(entrants) - len(holes))
        total, live = offsets[-1] + appended, self.num_rows
        left = len(holes) - len(entrants) + appended
        if total > self.storage.capacity or (left and (
                self.buckets is None or left > total // 4
                or pick_bucket(total, self.buckets) != pick_bucket(live, self.buckets))):
            return None
        return self._apply_patch(old, fresh, holes, leaving, staying, entrants, total)

    def _apply_patch(self, old: Layout, fresh: list[tuple[int, int, Block]], holes: list[int],
                     leaving: list[int], staying: list[DeviceReq], entrants: list[DeviceReq],
                     total: int) -> Layout:
        cols = old.cols.copy()
        offsets = cols.offsets
        reqs, rows, owners = list(old.reqs), list(old.rows), list(old.owners)
        for i in leaving:
            reqs[i] = hole = self._hole()
            rows[offsets[i]], owners[offsets[i]] = hole.blocks[0], hole
            cols.set(i, hole)
        placed: list[int] = []  # positions the entrants take
        for r in entrants:
            if holes:
                i = holes.pop(0)
                reqs[i], owners[offsets[i]] = r, r
                cols.set(i, r)
            else:
                i = len(reqs)
                reqs.append(r)
                rows.append(r.blocks[0])
                owners.append(r)
                cols.append(r)
            r.pos = i
            placed.append(i)
            fresh.append((offsets[i], i, r.blocks[0]))  # its row is set with the others below
        for r in staying:
            cols.first_starts[r.pos] = r.first_start
        for b in self.gone:
            b.row = -1
        for r in entrants:
            self._enter(r)
        for i in leaving:
            self._leave(old.reqs[i])
        at = np.fromiter((x for x, _, _ in fresh), np.int64, len(fresh))
        where = np.fromiter((p for _, p, _ in fresh), np.int64, len(fresh))
        blocks = [b for _, _, b in fresh]
        steps = np.zeros(total, dtype=np.int64)
        steps[:len(old.rows)] = old.steps
        steps[at] = [b.init_steps for b in blocks]
        self.storage.write_rows(at, _init_ids(blocks), [b.init_state for b in blocks],
                                np.fromiter((b.start for b in blocks), np.int64, len(blocks)),
                                where, np.array([reqs[i].settings.seed for i in where.tolist()],
                                                dtype=np.int64))
        if placed:
            self.storage.write_params(np.asarray(placed, dtype=np.int64),
                                      self._params([reqs[i] for i in placed]), total, len(reqs))
        for x, _, b in fresh:
            rows[x] = b
            b.row, b.init_ids, b.init_state = x, None, None
        return Layout(reqs, rows, owners, self._batch(cols, steps),
                      self.storage.views(total)[1], cols, holes)

    def _hole(self) -> DeviceReq:
        return DeviceReq(-1, self.scratch_slot, HOLE_SETTINGS, 0, [Block(0, alive=False)],
                         alive=False, hole=True)

    def _batch(self, cols: Columns, steps: np.ndarray) -> DenoiseBatch:
        """The DenoiseBatch of rows [0, N) laid out as `cols` says (it shares their lists:
        a later patch copies them before it changes anything)."""
        n = cols.offsets[-1]
        ids, _ = self.storage.views(n)
        batch = DenoiseBatch(
            block_ids=ids, num_blocks=cols.counts, first_starts=cols.first_starts,
            temperatures=cols.temperatures, top_ps=cols.top_ps, seeds=cols.seeds,
            params=self.storage.req_params, block_steps=steps, top_ks=cols.top_ks,
            min_ps=cols.min_ps)
        batch.bind_rows(*self.storage.row_views(n))
        return batch

    def _retire_layout(self, old: Layout | None) -> None:
        """Fold the replaced layout's step counts into its blocks; its rows leave it."""
        if old is None:
            return
        for i, b in enumerate(old.rows):
            b.init_steps, b.row = int(old.steps[i]), -1

    def _gather(self, old: Layout | None, fresh: list[Block], index: np.ndarray,
                ) -> tuple[torch.Tensor, State | None]:
        """ids (N, K) and state of the new row order: rows of `old` then `fresh`, by index
        (one host-to-device copy: the index and the fresh blocks' ids together)."""
        n, m = len(index), len(fresh)
        packed = to_device(np.concatenate([index, _init_ids(fresh).reshape(-1)]), self.device)
        idx, new_ids = packed[:n], packed[n:].view(m, self.k)
        new_state = self.storage.fresh_state(new_ids, [b.init_state for b in fresh])
        if old is None or not old.rows:
            return new_ids[idx], (None if new_state is None
                                  else {key: v[idx] for key, v in new_state.items()})
        ids = torch.cat([old.batch.block_ids, new_ids])[idx]
        if new_state is None or old.state is None:
            return ids, None
        return ids, {key: torch.cat([old.state[key], new_state[key]])[idx] for key in new_state}

    def _params(self, reqs: list[DeviceReq]) -> np.ndarray:
        """(P, B) per-request values of the algorithm's request_params (defaults where unset)."""
        out = np.repeat(self.storage.defaults[:, None], len(reqs), axis=1)
        for b, r in enumerate(reqs):
            for i, name in enumerate(self.algo.request_params):
                if name in r.settings.params:
                    out[i, b] = r.settings.params[name]
        return out

    def host_rows(self, req: DeviceReq) -> tuple[np.ndarray, list[RowState | None]]:
        """The request's blocks as they are on the device now (a host sync): ids (n, K) and
        per-block states. Blocks not yet on the device come from their init values."""
        cur = self.current
        ids, states = [], []
        for b in req.blocks:
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
    return np.stack([b.init_ids for b in blocks]).astype(np.int64, copy=False)
