"""Every message that crosses a process boundary, and the one codec (pickle protocol 5).

Token ids travel as numpy arrays, never as lists of Python ints on the hot path.

front -> scheduler: GenerateReq, AbortReq, InfoReq, FlushCacheReq, Shutdown.
scheduler -> front: Ready, BatchOutput, InfoResp, FlushCacheResp, Fatal.
scheduler -> worker: WorkerBatch (changes only: AddPages, Prefill, Admit, Release, Preempt),
    Shutdown.
worker -> scheduler: WorkerReady, WorkerReport (results only: retired blocks, preempted and
    failed requests, counters), WorkerFailed.

Ownership of a request's unfinished blocks (the rule the runtime rests on): from `Admit` until
they leave, the worker owns them on the device (ids, algorithm state, step counts), and it opens
the request's next blocks itself while the request's pages cover them. A block leaves the
device batch by retiring (reported in `Retired`, then committed by the scheduler), by
`Preempt` (reported in `Preempted`; the scheduler stores the blocks in
`Req.dllm_incomplete_ids` / `Req.dllm_algo_state` and may `Admit` them again), by `Release`
(the request finished or was aborted: dropped) or by failing (`Failed`). Requests are named on
this channel by `uid`, unique per admission, so a late report about a request that has since
finished is recognised and dropped.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

import numpy as np

from dllm_serve.sampling_params import SamplingParams

RowState = dict[str, np.ndarray]  # one block's algorithm state, opaque to the scheduler

# ---- front -> scheduler -----------------------------------------------------------------


@dataclass
class GenerateReq:
    rid: str
    input_ids: np.ndarray  # (prompt_len,) int64
    params: SamplingParams
    arrival: float  # time.monotonic() in the front

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled with the prompt as raw bytes (see `_ints`)."""
        return _unpack_generate, (self.rid, _raw(self.input_ids), self.params, self.arrival)


def _unpack_generate(rid: str, input_ids: bytes, params: SamplingParams,
                     arrival: float) -> GenerateReq:
    return GenerateReq(rid, _ints(input_ids, (-1,)), params, arrival)


@dataclass
class AbortReq:
    rid: str | None = None
    abort_all: bool = False
    message: str = "aborted"


@dataclass
class InfoReq:
    """Asks the scheduler for its state; the reply carries the same `req_id`."""

    req_id: int = 0


@dataclass
class FlushCacheReq:
    """Empty the radix prefix cache; the reply (FlushCacheResp) carries the same `req_id`."""

    req_id: int = 0


# ---- scheduler -> front -----------------------------------------------------------------


@dataclass
class ReqOutput:
    """New committed tokens of one request (a block's worth, or fewer at the end)."""

    rid: str
    new_ids: np.ndarray  # (n,) int64
    finished: bool = False
    # {"type": "stop", "matched": id | str (, "at": where it starts in the text; the front
    # takes it out)} | {"type": "length", "length": n}
    # | {"type": "abort", "message": str, "status_code": int}
    # | {"type": "error", "message": str, "status_code": 500} (this request failed alone)
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forward_steps: int = 0  # forwards this request took part in (prefill included)
    denoise_steps: int = 0  # of which denoise forwards
    blocks: int = 0  # committed generation blocks
    block_forwards: list[int] = field(default_factory=list)  # per block; sent with the last output
    block_edits: list[int] = field(default_factory=list)  # per block; sent with the last output
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (SGLang's meta_info key)


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]

    def __reduce__(self) -> tuple[Any, tuple[list[tuple[Any, ...]], bytes]]:
        """Pickled packed (outputs travel only in batches): every output's new ids in one raw
        int64 buffer, each output its values in order with its ids' count, one buffer and
        one array decoded per batch (the scheduler sends a batch after each report, an output
        a block). A dataclass pickles its field names with each instance and a numpy array
        its dtype and shape: 8 outputs took 27.8 us to encode that way, one by one as values
        with raw ids 9.8, packed 7.4 (benchmarks/wire_codec.py on the CPU)."""
        ids = [o.new_ids for o in self.outputs]
        data = _raw(np.concatenate(ids)) if ids else b""
        return _unpack_outputs, ([(o.rid, len(i), o.finished, o.finish_reason, o.prompt_tokens,
                                   o.completion_tokens, o.forward_steps, o.denoise_steps,
                                   o.blocks, o.block_forwards, o.block_edits, o.cached_tokens)
                                  for o, i in zip(self.outputs, ids, strict=True)], data)


def _unpack_outputs(records: list[tuple[Any, ...]], data: bytes) -> BatchOutput:
    flat = _ints(data, (-1,))  # each output's ids are a view of this one (writable) array
    outputs, at = [], 0
    for rid, n, *rest in records:
        outputs.append(ReqOutput(rid, flat[at:at + n], *rest))
        at += n
    return BatchOutput(outputs)


@dataclass
class InfoResp:
    req_id: int
    info: dict[str, Any]


@dataclass
class FlushCacheResp:
    """success False: refused (requests are running or waiting); `message` says why."""

    req_id: int
    success: bool
    message: str
    freed_pages: int = 0


@dataclass
class Ready:
    info: dict[str, Any]


@dataclass
class Fatal:
    """The scheduler (or its worker) cannot go on; the front fails every request. `reason`:
    one line for the user (the failing process logged its traceback, `message`, already)."""

    message: str
    reason: str = ""


# ---- scheduler -> worker: changes -------------------------------------------------------


@dataclass
class ReqSettings:
    """What the worker needs to run one request's blocks; fixed for the request's life.

    stop_ids: tokens that end the output (EOS unless ignore_eos, and stop_token_ids). The worker
    opens no block after one whose generated part holds such a token, and none past max_end
    (prompt_len + max_new_tokens rounded up to a block); the scheduler's finish check, which also
    knows stop strings, has the last word.
    """

    prompt_len: int
    max_end: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    params: dict[str, float] = field(default_factory=dict)  # per-request algorithm overrides
    stop_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    top_k: int = -1  # -1: off
    min_p: float = 0.0


@dataclass
class AddPages:
    """Page-table entries [first, first + len(pages)) of the request in `slot`."""

    slot: int
    first: int
    pages: np.ndarray  # (n,) int64


@dataclass
class Prefill:
    """One prefill forward: per row, prompt tokens at positions [seg_start, seg_start + len)
    (whole blocks) of the request in slots[i], whose pages are already mapped."""

    slots: list[int]
    seg_starts: list[int]
    token_ids: list[np.ndarray]  # (seg_len,) int64 each, seg_len a multiple of block_size


@dataclass
class Admit:
    """Start (or resume after a preemption) denoising a request's blocks: n contiguous blocks
    from first_start; states[i] None means block i starts now (fresh algorithm state)."""

    uid: int
    slot: int
    first_start: int
    blocks: np.ndarray  # (n, block_size) int64
    states: list[RowState | None]
    block_steps: list[int]
    settings: ReqSettings


@dataclass
class Release:
    """The request finished or was aborted: drop its blocks (nothing is reported)."""

    uid: int


@dataclass
class Preempt:
    """Take the request's blocks off the device and report them in `Preempted`."""

    uid: int


WorkItem = AddPages | Prefill | Admit | Release | Preempt


@dataclass
class WorkerBatch:
    """The scheduler's changes of one loop iteration, applied by the worker in order."""

    items: list[WorkItem]

    def __reduce__(self) -> tuple[Any, tuple[list[Any], bytes]]:
        """Pickled packed (`_pack_items`): the items' int arrays (pages, blocks, stop ids,
        prompt tokens) in one raw int64 buffer, each AddPages / Admit / Prefill / Release a
        tuple of scalars with its arrays' offsets there; the worker's items get views of the
        one array made from it.
        Pickled one by one, each array cost a decode of its own (a batch admitting 8
        requests: `python benchmarks/wire_codec.py`)."""
        return _unpack_batch, _pack_items(self.items)


@dataclass
class Shutdown:
    pass


# ---- worker -> scheduler: results -------------------------------------------------------


@dataclass
class WorkerReady:
    num_pages: int
    page_size: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Retired:
    """R blocks whose final forward has run, in retirement order (a request's in position
    order): their tokens are final and their cached KV exact."""

    uids: np.ndarray  # (R,) int64
    starts: np.ndarray  # (R,) int64 absolute position of each block
    ids: np.ndarray  # (R, block_size) int64
    forwards: np.ndarray  # (R,) forwards each block took, its final (done-on-entry) one included
    edits: np.ndarray  # (R,) T2T edits each block had
    req_forwards: np.ndarray  # (R,) denoise forwards the block's request has taken part in

    def __len__(self) -> int:
        return len(self.uids)

    def __reduce__(self) -> tuple[Any, tuple[bytes, tuple[int, int]]]:
        """Pickled as one packed int64 table (R, 5 + K) of raw bytes: the six arrays pickled
        one by one took 29 us to encode a report of three blocks (CPU), this 12."""
        ids = np.asarray(self.ids)
        table = np.empty((len(self), 5 + ids.shape[1]), dtype=np.int64)
        for j, col in enumerate((self.uids, self.starts, self.forwards, self.edits,
                                 self.req_forwards)):
            table[:, j] = col
        table[:, 5:] = ids
        return _unpack_retired, (_raw(table), table.shape)


def _unpack_retired(data: bytes, shape: tuple[int, int]) -> Retired:
    table = _ints(data, shape)
    return Retired(table[:, 0], table[:, 1], table[:, 5:], table[:, 2], table[:, 3], table[:, 4])


@dataclass
class Preempted:
    uid: int
    first_start: int
    blocks: np.ndarray  # (n, block_size) int64
    states: list[RowState | None]
    block_steps: list[int]
    req_forwards: int


@dataclass
class Failed:
    """The request failed alone (non-finite logits, no convergence, an error in its step)."""

    uid: int
    message: str


@dataclass
class WorkerReport:
    """What happened since the worker's previous report. Counters: denoise forwards, prefill
    forwards, rounds (forwards after which a block retired), block_steps (active blocks summed
    over forwards), idle_block_steps (of which blocks past their final forward, waiting) and
    compiles (Triton kernels compiled after ready: kernels/compile_watch.py)."""

    retired: Retired | None = None
    preempted: list[Preempted] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    forwards: int = 0
    prefills: int = 0
    rounds: int = 0
    block_steps: int = 0
    idle_block_steps: int = 0
    compiles: int = 0

    @property
    def has_results(self) -> bool:
        return bool(self.retired is not None or self.preempted or self.failed)

    def __reduce__(self) -> tuple[type[WorkerReport], tuple[Any, ...]]:
        """Pickled as its fields' values in order (a dataclass pickles its field names with
        each instance; the worker sends a report after every forward that retires a block)."""
        return WorkerReport, _report_values(self)


_report_values = attrgetter(*(f.name for f in fields(WorkerReport)))  # every field, in order


@dataclass
class WorkerFailed:
    message: str  # the traceback (the worker logged it)
    reason: str = ""  # its last exception in one line


def one_line(e: BaseException) -> str:
    """An exception as one line for the user: its type and message, newlines joined."""
    return " ".join(f"{type(e).__name__}: {e}".split())


MESSAGE_TYPES: tuple[type, ...] = (
    GenerateReq, AbortReq, InfoReq, FlushCacheReq, ReqOutput, BatchOutput, InfoResp,
    FlushCacheResp, Ready, Fatal, ReqSettings, AddPages, Prefill, Admit, Release, Preempt,
    WorkerBatch, Shutdown, WorkerReady, Retired, Preempted, Failed, WorkerReport, WorkerFailed,
)


_PAGES, _ADMIT, _RELEASE, _PREFILL = 0, 1, 2, 3  # WorkerBatch's packed records (Preempt: as is)


def _pack_items(items: list[WorkItem]) -> tuple[list[Any], bytes]:
    """(records, raw int64 buffer): per item a tuple (kind, scalars..., offsets into the
    buffer) where it has arrays, else the item itself."""
    parts: list[np.ndarray] = []
    at = 0

    def put(a: np.ndarray) -> int:  # a's values appended to the buffer: their offset
        nonlocal at
        parts.append(a.reshape(-1))
        at += a.size
        return at - a.size

    records: list[Any] = []
    for item in items:
        if isinstance(item, AddPages):
            records.append((_PAGES, item.slot, item.first, put(item.pages), len(item.pages)))
        elif isinstance(item, Admit):
            st = item.settings
            n, k = item.blocks.shape
            records.append((_ADMIT, item.uid, item.slot, item.first_start, put(item.blocks), n,
                            k, item.states, item.block_steps, st.prompt_len, st.max_end,
                            st.temperature, st.top_p, st.seed, st.params, put(st.stop_ids),
                            len(st.stop_ids), st.top_k, st.min_p))
        elif isinstance(item, Release):
            records.append((_RELEASE, item.uid))
        elif isinstance(item, Prefill):
            records.append((_PREFILL, item.slots, item.seg_starts,
                            [(put(t), len(t)) for t in item.token_ids]))
        else:
            records.append(item)
    return records, (_raw(np.concatenate(parts)) if parts else b"")


def _unpack_batch(records: list[Any], data: bytes) -> WorkerBatch:
    flat = _ints(data, (-1,))  # every item's arrays are views of this one (writable) array
    items: list[WorkItem] = []
    for r in records:
        if type(r) is not tuple:
            items.append(r)
        elif r[0] == _PAGES:
            _, slot, first, at, n = r
            items.append(AddPages(slot, first, flat[at:at + n]))
        elif r[0] == _ADMIT:
            (_, uid, slot, first_start, at, n, k, states, block_steps, prompt_len, max_end,
             temperature, top_p, seed, params, stop_at, stops, top_k, min_p) = r
            items.append(Admit(uid, slot, first_start, flat[at:at + n * k].reshape(n, k),
                               states, block_steps, ReqSettings(
                                   prompt_len, max_end, temperature, top_p, seed, params,
                                   flat[stop_at:stop_at + stops], top_k, min_p)))
        elif r[0] == _PREFILL:
            _, slots, seg_starts, segments = r
            items.append(Prefill(slots, seg_starts, [flat[at:at + n] for at, n in segments]))
        else:
            items.append(Release(r[1]))
    return WorkerBatch(items)


def _raw(a: np.ndarray) -> bytes:
    """An int array's values as raw int64 bytes."""
    return np.ascontiguousarray(a, dtype=np.int64).tobytes()


def _ints(data: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The int64 array of `_raw` bytes, its own (writable) copy: a view of the message's bytes
    would be read-only, which torch.from_numpy warns about. A pickled numpy array costs several
    microseconds to encode and decode; raw bytes a fraction."""
    return np.frombuffer(data, dtype=np.int64).reshape(shape).copy()


def encode(msg: object) -> bytes:
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return pickle.dumps(msg, protocol=5)


def decode(data: bytes | memoryview) -> Any:
    msg = pickle.loads(data)
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"received a non-message object: {type(msg).__name__}")
    return msg
