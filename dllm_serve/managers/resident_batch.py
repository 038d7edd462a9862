"""`ResidentBatch`: the worker's running batch, kept on the device across forwards.

It holds every admitted request (`DeviceReq`: slot, settings) and its active blocks (`Block`),
and their device tensors: ids (N, K) and the algorithm's state (N, ...) in rows [0, N) of the
worker's `RowStorage`, ordered by request (admission order) and within a request by position.
A block that stays is never re-sent, re-uploaded or copied to the host; only when the set of
blocks changes (a block opens or leaves) does `layout()` gather the surviving rows, append the
new blocks' ids and fresh state, and write them back to rows [0, N), with the per-row metadata
(request index, position, seed) and per-request settings, in two host-to-device copies.
Per-forward bookkeeping is O(1) in Python: each layout counts its rows' steps in one numpy
array (`Layout.steps`, also the batch's `block_steps`) and its forwards in one counter, folded
back into the blocks and requests when the layout is replaced.
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


@dataclass(eq=False)
class DeviceReq:
    uid: int
    slot: int
    settings: ReqSettings
    next_start: int  # where its next block opens (the end of its blocks)
    blocks: list[Block] = field(default_factory=list)
    past_forwards: int = 0  # forwards of layouts already replaced
    in_layout: bool = False  # it has rows in the current layout
    alive: bool = True

    @property
    def first_start(self) -> int:
        return self.blocks[0].start if self.blocks else self.next_start


@dataclass
class Layout:
    """The rows of the device tensors: blocks in row order and the requests that own them;
    steps (N,) forwards each row has had (the batch's block_steps); launches: forwards run
    over this layout."""

    reqs: list[DeviceReq]
    rows: list[Block]
    owners: list[DeviceReq]  # the request of each row
    batch: DenoiseBatch
    state: State | None
    launches: int = 0

    @property
    def steps(self) -> np.ndarray:
        return self.batch.block_steps


class ResidentBatch:
    def __init__(self, algo: DllmAlgorithm, storage: RowStorage) -> None:
        self.algo = algo
        self.storage = storage
        self.device = storage.device
        self.k = storage.k
        self.reqs: dict[int, DeviceReq] = {}  # admission order
        self.current: Layout | None = None  # the layout of the device tensors
        self.dirty = False
        self.num_rows = 0

    # ---- membership ---------------------------------------------------------------------

    def add(self, req: DeviceReq) -> None:
        self.reqs[req.uid] = req
        self.num_rows += len(req.blocks)
        self.dirty = True

    def drop(self, req: DeviceReq) -> None:
        """Remove the request and its blocks (they are never reported)."""
        req.alive = False
        for block in req.blocks:
            block.alive = False
        if self.reqs.pop(req.uid, None) is not None:
            self.num_rows -= len(req.blocks)
        self.dirty = True

    def open_block(self, req: DeviceReq) -> None:
        """Append an all-mask block at req.next_start (fresh state)."""
        mask = np.full(self.k, self.algo.mask_id, dtype=np.int64)
        req.blocks.append(Block(req.next_start, init_ids=mask))
        req.next_start += self.k
        self.num_rows += 1
        self.dirty = True

    def retire(self, req: DeviceReq, count: int) -> list[Block]:
        """Remove the request's `count` leading blocks (their final forward has run)."""
        gone, req.blocks = req.blocks[:count], req.blocks[count:]
        for block in gone:
            block.alive = False
        self.num_rows -= len(gone)
        self.dirty = self.dirty or bool(gone)
        return gone

    def steps(self, block: Block) -> int:
        """Forwards the block has had."""
        cur = self.current
        if block.row >= 0 and cur is not None:
            return int(cur.steps[block.row])
        return block.init_steps

    def forwards(self, req: DeviceReq) -> int:
        """Denoise forwards the request has taken part in."""
        cur = self.current
        return req.past_forwards + (cur.launches if req.in_layout and cur is not None else 0)

    # ---- the device tensors -------------------------------------------------------------

    def layout(self) -> Layout:
        """The current layout, rebuilt (rows gathered, new blocks appended) if anything
        changed since the last call."""
        if self.dirty or self.current is None:
            self.current = self._rebuild()
            self.dirty = False
        return self.current

    def _rebuild(self) -> Layout:
        reqs = [r for r in self.reqs.values() if r.blocks]
        rows = [b for r in reqs for b in r.blocks]
        old = self.current
        if old is not None and _same_shape(old, reqs, rows):
            return self._renew(old, rows)
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
        for r in reqs:
            r.in_layout = True
        counts = [len(r.blocks) for r in reqs]
        seeds = [r.settings.seed for r in reqs]
        self.storage.write_meta(np.repeat(np.arange(len(reqs)), counts),
                                np.fromiter((b.start for b in rows), np.int64, len(rows)),
                                np.repeat(np.asarray(seeds, dtype=np.int64), counts),
                                self._params(reqs))
        ids, state = self.storage.views(len(rows))
        batch = DenoiseBatch(
            block_ids=ids, num_blocks=counts, first_starts=[r.first_start for r in reqs],
            temperatures=[r.settings.temperature for r in reqs],
            top_ps=[r.settings.top_p for r in reqs], seeds=seeds,
            params=self.storage.req_params, block_steps=steps,
            top_ks=[r.settings.top_k for r in reqs], min_ps=[r.settings.min_p for r in reqs])
        n = len(rows)
        s = self.storage
        batch.bind_rows(s.row_req[:n], s.row_start[:n], s.row_seed[:n])
        owners = [r for r in reqs for _ in r.blocks]
        return Layout(reqs, rows, owners, batch, state)

    def _renew(self, old: Layout, rows: list[Block]) -> Layout:
        """The same requests with the same block counts, surviving blocks in place (FDFO's
        common case: a request's finished block replaced by its next one): only the rows of
        new blocks are written, in place; a new Layout (in-flight launches keep the old)."""
        fresh = [b for b in rows if b.row < 0]
        at = np.fromiter((i for i, b in enumerate(rows) if b.row < 0), np.int64, len(fresh))
        self.storage.write_rows(at, _init_ids(fresh), [b.init_state for b in fresh],
                                np.fromiter((b.start for b in fresh), np.int64, len(fresh)))
        steps = old.steps.copy()
        steps[at] = [b.init_steps for b in fresh]
        for r in old.reqs:
            r.past_forwards += old.launches
        for b in old.rows:
            if not b.alive:
                b.row = -1
        for i, b in zip(at.tolist(), fresh, strict=True):
            b.row, b.init_ids, b.init_state = i, None, None
        o = old.batch
        batch = DenoiseBatch(o.block_ids, o.num_blocks, [r.first_start for r in old.reqs],
                             o.temperatures, o.top_ps, o.seeds, o.params, steps,
                             top_ks=o.top_ks, min_ps=o.min_ps)
        batch.bind_rows(o.row_req, o.row_start, o.row_seed)
        return Layout(old.reqs, rows, old.owners, batch, old.state)

    def _retire_layout(self, old: Layout | None) -> None:
        """Fold the replaced layout's counters into its requests; its rows leave it."""
        if old is None:
            return
        for r in old.reqs:
            r.past_forwards += old.launches
            r.in_layout = False
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


def _same_shape(old: Layout, reqs: list[DeviceReq], rows: list[Block]) -> bool:
    """The same requests in the same order with the same block counts, and every surviving
    block at its old row (only new blocks take the places of retired ones)."""
    if len(reqs) != len(old.reqs) or any(a is not b for a, b in zip(reqs, old.reqs,
                                                                      strict=True)):
        return False
    if [len(r.blocks) for r in reqs] != old.batch.num_blocks:
        return False
    return all(b.row in (i, -1) for i, b in enumerate(rows))
