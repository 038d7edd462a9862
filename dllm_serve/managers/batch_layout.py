"""The records of the worker's resident batch (managers/resident_batch.py): a `Block` (one
active block and what the host has read back of it), a `DeviceReq` (an admitted request and its
active blocks), and a `Layout` (the rows of the device tensors, one block or hole each, with the
per-row host `Columns` the forward and the step read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.managers.messages import ReqSettings, RowState


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
    gate: int = 0  # it waits for its predecessor's flags (dllm/wavefront.py); 0 once open
    waited: int = 0  # forwards it had waiting (read back when it opened)


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
    seq: int = 0  # admission order (ResidentBatch.add)
    stops: frozenset[int] = field(init=False)  # settings.stop_ids as a set (the retire check's)

    def __post_init__(self) -> None:
        self.stops = frozenset(self.settings.stop_ids.tolist())

    @property
    def first_start(self) -> int:
        return self.blocks[0].start if self.blocks else self.next_start


@dataclass
class Columns:
    """Per row of a layout (N of them, host lists): what the forward and the step read of its
    block and request (each row is a segment of one block). A patch copies them and rewrites
    only the rows that changed."""

    slots: list[int]
    first_starts: list[int]
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int]
    top_ks: list[int]
    min_ps: list[float]

    @staticmethod
    def of(reqs: list[DeviceReq], rows: list[Block]) -> Columns:
        return Columns([r.slot for r in reqs], [b.start for b in rows],
                       *([getattr(r.settings, name) for r in reqs] for _, name in SETTING_COLUMNS))

    def patched(self, reqs: list[DeviceReq], rows: list[Block], changed: list[int]) -> Columns:
        """The columns of the N = len(rows) rows held by `rows` (owners `reqs`), made from
        these (left as they are): a copy of their rows [0, N), the rows past their end
        appended, and the `changed` rows rewritten, each once (indices >= N ignored; every row
        not among them must hold what it held here)."""
        n, kept = len(rows), min(len(rows), len(self.slots))
        cols = Columns(self.slots[:n], self.first_starts[:n], self.temperatures[:n],
                       self.top_ps[:n], self.seeds[:n], self.top_ks[:n], self.min_ps[:n])
        for i in range(kept, n):
            cols.append(reqs[i], rows[i])
        for i in {i for i in changed if i < kept}:
            cols.set(i, reqs[i], rows[i])
        return cols

    def set(self, row: int, req: DeviceReq, block: Block) -> None:
        """Row `row` := req's block."""
        self.slots[row], self.first_starts[row] = req.slot, block.start
        for column, name in SETTING_COLUMNS:
            getattr(self, column)[row] = getattr(req.settings, name)

    def append(self, req: DeviceReq, block: Block) -> None:
        """A new last row: req's block."""
        self.slots.append(req.slot)
        self.first_starts.append(block.start)
        for column, name in SETTING_COLUMNS:
            getattr(self, column).append(getattr(req.settings, name))


SETTING_COLUMNS = (("temperatures", "temperature"), ("top_ps", "top_p"), ("seeds", "seed"),
                   ("top_ks", "top_k"), ("min_ps", "min_p"))
COLUMN_FIELDS = ("slots", "first_starts", "temperatures", "top_ps", "seeds", "top_ks", "min_ps")


@dataclass(eq=False)
class Layout:
    """The rows of the device tensors: blocks in row order and the request of each (a hole's
    placeholder for a hole); steps (N,) forwards each row has had (the batch's block_steps);
    ids (N, K) and state: views of the storage rows [0, N). Invariant: rows[i].row == i for
    every real block, and holes lists (ascending) the rows held by a hole.

    The per-row host `Columns` and the `DenoiseBatch` over them are made on first use only:
    the graph path of a greedy batch (the forward's metadata computed on the device from the
    storage rows, the step captured with it) reads neither, so a layout change costs it no
    column work. `base` is the previous layout's columns if it made them (then `changed` lists
    the rows that differ: a patch), else None (made afresh from the rows)."""

    reqs: list[DeviceReq]
    rows: list[Block]
    steps: np.ndarray
    ids: torch.Tensor
    state: State | None
    holes: list[int]
    sampled: bool  # some row's request samples (temperature > 0)
    make_batch: Callable[[Columns, np.ndarray], DenoiseBatch]
    base: Columns | None = None
    changed: list[int] = field(default_factory=list)
    _cols: Columns | None = field(default=None, repr=False)
    _batch: DenoiseBatch | None = field(default=None, repr=False)

    @property
    def cols(self) -> Columns:
        if self._cols is None:
            self._cols = (Columns.of(self.reqs, self.rows) if self.base is None
                          else self.base.patched(self.reqs, self.rows, self.changed))
            self.base, self.changed = None, []
        return self._cols

    @property
    def batch(self) -> DenoiseBatch:
        """The DenoiseBatch of these rows (its block_steps is `steps`, the same array)."""
        if self._batch is None:
            self._batch = self.make_batch(self.cols, self.steps)
        return self._batch
