"""`RowStorage`: fixed device buffers that hold the resident batch's rows.

The active blocks always live in rows [0, N) of these buffers, so a CUDA graph captured once
over them (the forward and the greedy step together, model/denoise_graphs.py) reads and writes the
live batch directly. Buffers, `capacity` rows each:
  ids (capacity, K) int64                 block tokens (also the graphs' static input ids)
  state {key: (capacity, ...)}            the algorithm's per-block state
  row_req, row_start, row_seed (capacity,) int64: each row's request key (its request slot;
                                          `free_key` for a row of no request), block start and
                                          its request's sampling seed
  req_params {name: (keys,)} float32      per-request values of the algorithm's request_params
                                          (indexed by row_req), the config default where unset
                                          (one more column past the keys: the inbox's scratch)
  gate, flag (capacity,) int64 (gated storage only; the columns of one (capacity, 2) buffer): a
                                          row's gate (the flags of its predecessor that open
                                          it; 0: open) and its flags after its last step
                                          (converged | ready << 1), both moved with the row
                                          like its state (dllm/wavefront.py `open_gates`)
The page table (the KV cache's, when given) is written the same way: `stage_pages` packs the
scheduler's page mappings into the inbox after the rows, so a forward that a mapping precedes
applies it first thing, and mapping pages costs the host no device copy or scatter of its own
(those took 70-110 us a batch of mappings on an H200's host, up to 350: README, run 47). A
prefill reads the page table outside the denoise forward: `apply_pages` applies what is staged
at once before one.
Rows at N and past (graph padding) hold garbage that nothing reads back, but their row_req is
free_key (a layout that gives a row up writes it so): the step groups rows by row_req. One more
row past `capacity` (the scratch row) takes the unused records of the inbox.

Row writes are staged: `write_rows` packs the rows into the host inbox (kernels/row_inbox.py),
`write_params` appends the new requests' params to it, `flush` sends it to the device, and
`apply_staged` applies it: the runner calls it first thing in every denoise forward (inside the
forward's CUDA graph when there is one), so a patch of the resident batch costs the host one
message, whatever the algorithm's state. On CUDA the message goes through pinned memory that
the forward's first kernel reads (kernels/host_copy.py `StageRing`: no copy between replays;
each replay of a graph holding the fetch is counted with `replayed`), on the CPU by a copy.
Invariant: between `flush` and the next denoise forward nothing reads the staged rows.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch

from dllm_serve.dllm.algorithms.base import DllmAlgorithm, State
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.kernels.host_copy import StageRing
from dllm_serve.kernels.row_inbox import (
    FRESH_STATE,
    GATE_SHIFT,
    HAS_IDS,
    MOVED,
    PAGES,
    PARAMS,
    RECORD_HEAD,
    apply_rows,
    apply_rows_reference,
    record_width,
)
from dllm_serve.managers.messages import RowState
from dllm_serve.mem.kv_cache import PageWrite, write_end
from dllm_serve.utils.device import to_device

PAGE_ROOM = 2  # inbox records for page writes, per row of capacity (K page ids a record)


class RowStorage:
    def __init__(self, algo: DllmAlgorithm, capacity: int, block_size: int,
                 device: torch.device, free_key: int, gated: bool = False,
                 page_table: torch.Tensor | None = None) -> None:
        """free_key: row_req of rows that hold no request (holes, padding); request keys are
        below it (the runner's request slots and its scratch slot). gated: rows may wait for
        their predecessor (a gate and flags per row). page_table (slots, entries) int64: the
        KV cache's, whose last row is the scratch slot's (its last entry takes the unused
        records' writes); None: `stage_pages` stages nothing."""
        self.algo, self.capacity, self.k, self.device = algo, capacity, block_size, device
        self.free_key = free_key
        rows = capacity + 1  # the last: the scratch row
        self.all_ids = torch.full((rows, block_size), algo.mask_id, dtype=torch.int64,
                                  device=device)
        self.all_state = algo.init_step_state(self.all_ids)
        self.all_meta = torch.zeros(3, rows, dtype=torch.int64, device=device)
        self.ids = self.all_ids[:capacity]
        self.state = (None if self.all_state is None
                      else {key: v[:capacity] for key, v in self.all_state.items()})
        self.row_req, self.row_start, self.row_seed = self.all_meta[:, :capacity].unbind(0)
        self.defaults = np.array([float(getattr(algo.config, n)) for n in algo.request_params],
                                 dtype=np.float32)
        self.params = torch.tensor(self.defaults, device=device)[:, None].repeat(1, free_key + 2)
        self.row_req.fill_(free_key)
        # gated: per row its gate and its last flags (moved with the row; see open_gates)
        self.all_gates = (torch.zeros(rows, 2, dtype=torch.int64, device=device) if gated
                          else None)
        self.gate, self.flag = ((None, None) if self.all_gates is None
                                else self.all_gates[:capacity].unbind(1))
        # the per-row tensors a move carries to its target row (ids and gates move in
        # apply_rows)
        self.carried_by_moves = list((self.all_state or {}).values())
        self.width = record_width(block_size)
        # a layout change stages at most every row twice (a new block or a move, a freed row)
        # and each request's params once; page mappings take up to PAGE_ROOM more records
        self.page_table = page_table
        assert page_table is None or page_table.shape[1] >= 2, "the scratch slot's sink entry"
        records = (3 + (PAGE_ROOM if page_table is not None else 0)) * capacity
        self.inbox = torch.zeros(1 + records * self.width, dtype=torch.int64, device=device)
        self.staged = np.zeros(1 + records * self.width, dtype=np.int64)  # its host copy
        self.ring = (StageRing(len(self.staged), self.width, device)
                     if device.type == "cuda" else None)
        self.host_inbox = self.inbox.numpy() if self.ring is None else None  # the CPU inbox
        self.records = self.staged[1:].reshape(records, self.width)
        self.pending = 0  # row and params records staged and not yet sent (flush)
        self.page_writes: list[PageWrite] = []  # mappings staged and not yet sent
        self.page_slots: set[int] = set()  # their slots (one write each)
        self.page_records = 0  # the records they take
        self.sent = False  # rows sent and not yet applied by an eager apply_staged
        self.rows_sent = False  # the message sent holds rows (not only page writes)
        self._rows_arange = torch.arange(capacity, device=device)
        if device.type == "cuda":  # compile the apply kernel now (nothing staged: a no-op)
            self.sent = True
            self.apply_staged()
        self._cache: dict[int, tuple[torch.Tensor, State | None,
                                     tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    @cached_property
    def req_params(self) -> dict[str, torch.Tensor]:
        """{name: (capacity,) view of its row of `params`} (fixed views, made once)."""
        return {n: self.params[i] for i, n in enumerate(self.algo.request_params)}

    def write_rows(self, at: np.ndarray, ids: np.ndarray | None,
                   states: list[RowState | None] | None, starts: np.ndarray, reqs: np.ndarray,
                   seeds: np.ndarray, sources: np.ndarray | None = None,
                   gates: np.ndarray | None = None) -> None:
        """Rows `at` (M,) := block starts, request keys and seeds (M,); the first J rows
        (J = len(ids)) also get ids (J, K) (host) with fresh state (or a resumed block's own,
        from states (J,)) and gates (J,) (None: open; gated storage only) with flags 0; the
        next S rows (S = len(sources)) take the ids and state of rows
        `sources` (S,) (a move: no source may be written by this call); the other rows keep
        theirs. Staged: applied at the next denoise forward, after `flush`. The one way rows
        are written: a layout change stages its new blocks, the rows it moves and its new
        holes (metadata only) here."""
        m = len(at)
        if m == 0:
            return
        if self.pending:  # one staged write at a time: rows written twice stay ordered
            self.flush()
            self.apply_staged()
        rec = self.records[:m]
        rec[:, 0], rec[:, 1], rec[:, 2], rec[:, 3] = at, reqs, starts, seeds
        j = 0 if ids is None else len(ids)
        states = states or [None] * j
        # state written now, not by the inbox: a resumed block's own, and every fresh state of
        # an algorithm whose state init may not be captured in a graph
        carried = ([i for i, s in enumerate(states) if s is not None] if self.algo.graph_safe
                   else list(range(j)))
        rec[j:, 4] = 0
        if ids is not None and j:
            if gates is not None:
                assert self.all_gates is not None, "gates need a gated RowStorage"
                rec[:j, 4] = (gates << GATE_SHIFT) | (HAS_IDS | FRESH_STATE)
            else:
                rec[:j, 4] = HAS_IDS | FRESH_STATE
            rec[:j, RECORD_HEAD:] = ids
            if carried:
                rec[carried, 4] &= ~FRESH_STATE
        moved = 0 if sources is None else len(sources)
        assert j + moved <= self.capacity  # apply_staged looks for them there
        if moved:
            rec[j:j + moved, 4] = MOVED
            rec[j:j + moved, RECORD_HEAD] = sources
        self.pending = m
        if carried and self.state is not None:
            self._write_carried(at[carried], ids[carried], [states[i] for i in carried])

    def _write_carried(self, at: np.ndarray, ids: np.ndarray,
                       states: list[RowState | None]) -> None:
        """State rows `at` := fresh state for ids (M, K), with resumed blocks' own values
        (states[i] not None) over it (the inbox leaves these rows' state alone)."""
        assert self.state is not None
        state = self.algo.init_step_state(to_device(ids, self.device))
        for i, carried in enumerate(states):
            for key, value in (carried or {}).items():
                assert state is not None
                state[key][i] = to_device(np.asarray(value), self.device)
        idx = to_device(at.astype(np.int64), self.device)
        for key, value in (state or {}).items():
            self.state[key].index_copy_(0, idx, value)

    def stage_pages(self, writes: list[PageWrite]) -> bool:
        """Stage page-table writes (slot, first entry, page ids) for the next denoise forward,
        after `flush`. False (nothing staged): no page table, no room left, or a slot that the
        writes or those staged already write (the inbox applies its records in any order, so
        one message writes each slot once); the caller then writes them itself, after
        `apply_pages`, so that they stay in order. ValueError: a write past the table."""
        if self.page_table is None:
            return False
        entries = self.page_table.shape[1]
        for _, first, pages in writes:  # a record past the table would write out of bounds
            write_end(first, pages, entries)
        slots = {slot for slot, _, _ in writes}
        need = sum(-(-len(pages) // self.k) for _, _, pages in writes)
        if (len(slots) < len(writes) or not slots.isdisjoint(self.page_slots)
                or self.page_records + need > PAGE_ROOM * self.capacity):
            return False
        self.page_writes += writes
        self.page_slots |= slots
        self.page_records += need
        return True

    def apply_pages(self) -> None:
        """Apply the staged page writes now (before anything outside a denoise forward reads
        the page table: a prefill, or a write of the caller's own)."""
        if self.page_writes:
            self.flush()
            self.apply_staged()

    def _pack_pages(self, first: int) -> int:
        """The staged page writes as PAGES records from record `first` on; the records
        packed."""
        writes, self.page_writes, self.page_slots, self.page_records = (
            self.page_writes, [], set(), 0)
        k, e = self.k, first
        for slot, start, pages in writes:
            for at in range(0, len(pages), k):
                chunk = pages[at:at + k]
                rec = self.records[e]
                rec[:RECORD_HEAD] = (slot, 0, start + at, len(chunk), PAGES)
                rec[RECORD_HEAD:RECORD_HEAD + len(chunk)] = chunk
                e += 1
        return e - first

    def flush(self) -> None:
        """Send the staged rows and page writes to the device (CUDA: a message the next
        forward's fetch takes into the inbox; the CPU: a copy into the inbox); the next
        denoise forward applies them."""
        rows = self.pending > 0
        if self.page_writes:
            self.pending += self._pack_pages(self.pending)
        if not self.pending:
            return
        n = 1 + self.pending * self.width
        self.staged[0] = self.pending
        if self.ring is not None:
            self.ring.post(self.staged[:n])
        else:  # the CPU: a numpy copy into the inbox (no torch op, as the ring's post)
            assert self.host_inbox is not None
            self.host_inbox[:n] = self.staged[:n]
        self.pending, self.sent = 0, True
        self.rows_sent = rows

    def replayed(self) -> None:
        """A CUDA graph that captured `apply_staged` was replayed (its fetch was queued)."""
        if self.ring is not None:
            self.ring.replayed()

    @property
    def fetches(self) -> int:
        """The inbox fetches queued so far (CUDA; 0 elsewhere): what `ran` takes."""
        return 0 if self.ring is None else self.ring.queued

    def ran(self, fetches: int) -> None:
        """The first `fetches` fetches have run (the caller read a readout queued after
        them): their messages' slots may be written again without a device call."""
        if self.ring is not None:
            self.ring.ran(fetches)

    def apply_staged(self) -> None:
        """Apply the inbox on the device (the runner's hook before each denoise forward; no
        host sync, captured into the forward's graph). Eagerly, a no-op when nothing was sent."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not (self.sent or capturing):
            return
        self.sent = False
        if self.ring is not None:
            self.ring.fetch(self.inbox)
        if self.carried_by_moves and (self.rows_sent or capturing):  # before apply_rows
            # zeroes the count (a message of page writes alone moves no state)
            records, staged = self._staged()
            self._move_rows(records, staged)
            if self.all_state is not None and self.algo.graph_safe:
                self._fresh_state(records, staged)
        apply = apply_rows if self.device.type == "cuda" else apply_rows_reference
        apply(self.inbox, self.all_ids, self.all_meta, self.params, self.all_gates,
              self.page_table)

    def _staged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The inbox's first `capacity` records (capacity, width) and which of them are staged
        (capacity,) bool: the records of new blocks and moves are among them (write_rows stages
        them first; freed rows and params after them)."""
        records = self.inbox[1:1 + self.capacity * self.width].view(self.capacity, self.width)
        return records, self._rows_arange < self.inbox[0]

    def _move_rows(self, records: torch.Tensor, staged: torch.Tensor) -> None:
        """Each MOVED record's row takes its source row's state (the scratch row takes the
        other records'). Sources are never targets of the same write, so the order of the
        copies does not matter; the ids and gates move in apply_rows."""
        moved = staged & ((records[:, 4] & MOVED) != 0)
        target = torch.where(moved, records[:, 0], self.capacity)
        source = torch.where(moved, records[:, RECORD_HEAD], self.capacity)
        for value in self.carried_by_moves:
            value.index_copy_(0, target, value.index_select(0, source))

    def _fresh_state(self, records: torch.Tensor, staged: torch.Tensor) -> None:
        """Rows of FRESH_STATE records := the algorithm's fresh state for their ids."""
        assert self.all_state is not None
        fresh = self.algo.init_step_state(records[:, RECORD_HEAD:])
        due = staged & ((records[:, 4] & FRESH_STATE) != 0)
        rows = torch.where(due, records[:, 0], self.capacity)
        for key, value in (fresh or {}).items():
            self.all_state[key].index_copy_(0, rows, value)

    def write_params(self, at: np.ndarray, params: np.ndarray) -> None:
        """Request keys `at` (M,) := per-request params (P, M), staged after the rows (one
        PARAMS record each: applied with them at the next denoise forward, after `flush`)."""
        if not params.size:
            return
        m, first = len(at), self.pending
        rec = self.records[first:first + m]
        rec[:, 0], rec[:, 1:4], rec[:, 4] = at, 0, PARAMS
        bits = params.astype(np.float32).view(np.int32).T  # (M, P) the floats' bits
        rec[:, RECORD_HEAD:RECORD_HEAD + params.shape[0]] = bits
        self.pending = first + m

    def views(self, n: int) -> tuple[torch.Tensor, State | None]:
        """ids (n, K) and state views of rows [0, n) (made once per n: a view costs a
        dispatch, and a layout change asks for them every forward)."""
        return self._views(n)[:2]

    def row_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """row_req, row_start, row_seed views (n,) of rows [0, n)."""
        return self._views(n)[2]

    def _views(self, n: int) -> tuple[torch.Tensor, State | None,
                                      tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        cached = self._cache.get(n)
        if cached is None:
            state = None if self.state is None else {k: v[:n] for k, v in self.state.items()}
            rows = (self.row_req[:n], self.row_start[:n], self.row_seed[:n])
            cached = self._cache[n] = (self.ids[:n], state, rows)
        return cached

    def gate_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """gate, flag views (n,) of rows [0, n); None on storage without gates."""
        if self.gate is None or self.flag is None:
            return None
        return self.gate[:n], self.flag[:n]

    def graph_batch(self, n: int) -> DenoiseBatch:
        """A greedy DenoiseBatch over rows [0, n) made only of these buffers: what a captured
        step sees (its per-request lists are placeholders a greedy step never reads)."""
        batch = DenoiseBatch(
            block_ids=self.ids[:n], num_blocks=[1] * n, first_starts=[0] * n,
            temperatures=[0.0] * n, top_ps=[1.0] * n, seeds=[0] * n,
            params={name: v for name, v in self.req_params.items()},
            block_steps=np.zeros(n, dtype=np.int64))
        batch.bind_rows(*self.row_views(n))
        batch.gates = self.gate_views(n)
        return batch

