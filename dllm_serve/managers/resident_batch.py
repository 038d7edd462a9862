"""`ResidentBatch`: the worker's running batch, kept on the device across forwards.

It holds every admitted request (`DeviceReq`: slot, settings, mapped pages) and its active
blocks (`Block`), and the device tensors of those blocks: ids (N, K) and the algorithm's state
(N, ...), rows ordered by request (admission order) and within a request by position. A block
that stays is never re-sent, re-uploaded or copied to the host; only when the set of blocks
changes (a block opens or leaves) does `layout()` gather the surviving rows into new tensors
and append the new blocks' ids and fresh state. The host keeps per block what it has read back
(`Block.converged`, `ready`, `ids` of the last collected step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.managers.messages import ReqSettings, RowState


@dataclass(eq=False)
class Block:
    """One active block. init_ids / init_state: its ids and state until it is on the device."""

    start: int
    init_ids: np.ndarray | None = None  # (K,)
    init_state: RowState | None = None
    steps: int = 0  # forwards it has been in
    final_step: int = 0  # steps at its final (done-on-entry) forward; 0 until known
    alive: bool = True
    converged: bool = False  # read back: the next forward is its final one
    ready: bool = False  # read back: the wavefront may open the block after it
    ids: np.ndarray | None = None  # (K,) read back after its last collected step
    edits: int = 0


@dataclass(eq=False)
class DeviceReq:
    uid: int
    slot: int
    settings: ReqSettings
    next_start: int  # where its next block opens (the end of its blocks)
    blocks: list[Block] = field(default_factory=list)
    forwards: int = 0
    alive: bool = True

    @property
    def first_start(self) -> int:
        return self.blocks[0].start if self.blocks else self.next_start


@dataclass
class Layout:
    """The rows of one forward: blocks in row order, and the requests that own them."""

    reqs: list[DeviceReq]
    rows: list[Block]
    owners: list[DeviceReq]  # the request of each row
    batch: DenoiseBatch
    state: State | None


class ResidentBatch:
    def __init__(self, algo: DllmAlgorithm, device: torch.device, block_size: int) -> None:
        self.algo = algo
        self.device = device
        self.k = block_size
        self.reqs: dict[int, DeviceReq] = {}  # admission order
        self.current: Layout | None = None  # the layout of the device tensors
        self.dirty = False

    # ---- membership ---------------------------------------------------------------------

    def add(self, req: DeviceReq) -> None:
        self.reqs[req.uid] = req
        self.dirty = True

    def drop(self, req: DeviceReq) -> None:
        """Remove the request and its blocks (they are never reported)."""
        req.alive = False
        for block in req.blocks:
            block.alive = False
        self.reqs.pop(req.uid, None)
        self.dirty = True

    def open_block(self, req: DeviceReq) -> None:
        """Append an all-mask block at req.next_start (fresh state)."""
        mask = np.full(self.k, self.algo.mask_id, dtype=np.int64)
        req.blocks.append(Block(req.next_start, init_ids=mask))
        req.next_start += self.k
        self.dirty = True

    def retire(self, req: DeviceReq, count: int) -> list[Block]:
        """Remove the request's `count` leading blocks (their final forward has run)."""
        gone, req.blocks = req.blocks[:count], req.blocks[count:]
        for block in gone:
            block.alive = False
        self.dirty = self.dirty or bool(gone)
        return gone

    @property
    def num_rows(self) -> int:
        return sum(len(r.blocks) for r in self.reqs.values())

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
        old_rows = {id(b): i for i, b in enumerate(old.rows)} if old is not None else {}
        fresh = [b for b in rows if id(b) not in old_rows]
        n_old = len(old.rows) if old is not None else 0
        new_rows = {id(b): n_old + i for i, b in enumerate(fresh)}
        index = [old_rows.get(id(b), new_rows.get(id(b), -1)) for b in rows]
        ids, state = self._gather(old, fresh, index)
        for b in fresh:
            b.init_ids, b.init_state = None, None
        batch = DenoiseBatch(
            block_ids=ids, num_blocks=[len(r.blocks) for r in reqs],
            first_starts=[r.first_start for r in reqs],
            temperatures=[r.settings.temperature for r in reqs],
            top_ps=[r.settings.top_p for r in reqs], seeds=[r.settings.seed for r in reqs],
            params=self._params(reqs), block_steps=np.array([b.steps for b in rows], np.int64),
            top_ks=[r.settings.top_k for r in reqs], min_ps=[r.settings.min_p for r in reqs])
        owners = [r for r in reqs for _ in r.blocks]
        return Layout(reqs, rows, owners, batch, state)

    def _gather(self, old: Layout | None, fresh: list[Block], index: list[int],
                ) -> tuple[torch.Tensor, State | None]:
        """ids (N, K) and state of the new row order: surviving rows of `old` then `fresh`."""
        k, dev = self.k, self.device
        new_ids = torch.from_numpy(np.stack([b.init_ids for b in fresh]) if fresh
                                   else np.zeros((0, k), np.int64)).to(dev)
        new_state = self._fresh_state(new_ids, fresh)
        idx = torch.as_tensor(index, dtype=torch.int64, device=dev)
        if old is None or not old.rows:
            return new_ids[idx], (None if new_state is None
                                  else {key: v[idx] for key, v in new_state.items()})
        ids = torch.cat([old.batch.block_ids, new_ids])[idx]
        if new_state is None or old.state is None:
            return ids, None
        return ids, {key: torch.cat([old.state[key], new_state[key]])[idx] for key in new_state}

    def _fresh_state(self, ids: torch.Tensor, fresh: list[Block]) -> State | None:
        """State for the new rows: fresh from the algorithm, carried values where a resumed
        block brought its own."""
        state = self.algo.init_step_state(ids)
        if state is None:
            return None
        for i, block in enumerate(fresh):
            for key, value in (block.init_state or {}).items():
                state[key][i] = torch.as_tensor(value, device=ids.device)
        return state

    def _params(self, reqs: list[DeviceReq]) -> dict[str, torch.Tensor]:
        """Per-request values (B,) of the settings any request overrides."""
        names = sorted({name for r in reqs for name in r.settings.params})
        cfg = self.algo.config
        return {name: torch.tensor([r.settings.params.get(name, getattr(cfg, name))
                                    for r in reqs], dtype=torch.float32, device=self.device)
                for name in names}

    def host_rows(self, req: DeviceReq) -> tuple[np.ndarray, list[RowState | None]]:
        """The request's blocks as they are on the device now (a host sync): ids (n, K) and
        per-block states. Blocks not yet on the device come from their init values."""
        cur = self.current
        on_dev = {id(b): i for i, b in enumerate(cur.rows)} if cur is not None else {}
        ids, states = [], []
        for b in req.blocks:
            if id(b) in on_dev and b.init_ids is None:
                i = on_dev[id(b)]
                assert cur is not None
                ids.append(cur.batch.block_ids[i].cpu().numpy())
                states.append(None if cur.state is None else
                              {k: v[i].cpu().numpy() for k, v in cur.state.items()})
            else:
                ids.append(np.asarray(b.init_ids))
                states.append(b.init_state)
        return np.stack(ids), states
