"""Every message that crosses a process boundary, and the one codec (pickle protocol 5).

Token ids travel as numpy arrays, never as lists of Python ints on the hot path.
Directions: front -> scheduler (GenerateReq, AbortReq, InfoReq, FlushReq);
scheduler -> front (Ready, BatchOutput, InfoResp, Fatal);
scheduler -> worker (PrefillWork, DenoiseWork, Shutdown); worker -> scheduler
(WorkerReady, PrefillDone, RoundResult, WorkerFailed).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dllm_serve.sampling_params import SamplingParams

# ---- front -> scheduler -----------------------------------------------------------------


@dataclass
class GenerateReq:
    rid: str
    input_ids: np.ndarray  # (prompt_len,) int64
    params: SamplingParams
    arrival: float  # time.monotonic() in the front


@dataclass
class AbortReq:
    rid: str | None = None
    abort_all: bool = False
    message: str = "aborted"


@dataclass
class InfoReq:
    """Asks the scheduler for its state; the reply carries the same `req_id`."""

    req_id: int = 0


# ---- scheduler -> front -----------------------------------------------------------------


@dataclass
class ReqOutput:
    """New committed tokens of one request (a block's worth, or fewer at the end)."""

    rid: str
    new_ids: np.ndarray  # (n,) int64
    finished: bool = False
    # {"type": "stop", "matched": id | str} | {"type": "length", "length": n}
    # | {"type": "abort", "message": str, "status_code": int}
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    forward_steps: int = 0  # forwards this request took part in (prefill included)
    denoise_steps: int = 0  # of which denoise forwards
    blocks: int = 0  # committed generation blocks
    block_forwards: list[int] = field(default_factory=list)  # per block; sent with the last output
    block_edits: list[int] = field(default_factory=list)  # per block; sent with the last output


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]


@dataclass
class InfoResp:
    req_id: int
    info: dict[str, Any]


@dataclass
class Ready:
    info: dict[str, Any]


@dataclass
class Fatal:
    """The scheduler (or its worker) cannot go on; the front fails every request."""

    message: str


# ---- scheduler <-> worker ---------------------------------------------------------------


@dataclass
class PrefillWork:
    """Prompt blocks to cache: per row, tokens at positions [seg_start, seg_start + len)."""

    req_slots: list[int]
    pages: list[np.ndarray]  # each request's whole page list
    seg_starts: list[int]
    token_ids: list[np.ndarray]  # (seg_len,) int64 each, seg_len a multiple of block_size


@dataclass
class DenoiseWork:
    """The active blocks of each request: request b owns num_blocks[b] consecutive rows of
    block_ids, contiguous blocks from absolute position first_starts[b]; it may open new blocks
    up to position limits[b] (its pages cover that far)."""

    req_slots: list[int]
    pages: list[np.ndarray]
    first_starts: list[int]
    num_blocks: list[int]
    limits: list[int]
    block_ids: np.ndarray  # (N, K) int64
    states: list[dict[str, np.ndarray] | None]  # per block; None: the block starts now
    block_steps: np.ndarray  # (N,) int64 forwards each block has had
    temperatures: list[float]  # per request from here on
    top_ps: list[float]
    seeds: list[int]
    params: list[dict[str, float]]  # per-request algorithm overrides
    top_ks: list[int] = field(default_factory=list)  # per request; empty: off
    min_ps: list[float] = field(default_factory=list)


@dataclass
class Shutdown:
    pass


@dataclass
class WorkerReady:
    num_pages: int
    page_size: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class PrefillDone:
    forwards: int = 1


@dataclass
class RoundResult:
    """The blocks after the round, laid out like DenoiseWork (blocks opened inside the round
    included); request b commits its first retired[b] blocks (accept_length = retired * K)."""

    block_ids: np.ndarray  # (N', K) int64, as the last step left them
    num_blocks: list[int]
    retired: np.ndarray  # (B,) int64
    states: list[dict[str, np.ndarray] | None]  # per block; None for retired blocks
    block_steps: np.ndarray  # (N',) int64
    done_steps: np.ndarray  # (N',) block_steps when each block's run of done reports began
    forwards: int  # forwards run this round (every request took part in each)
    block_edits: np.ndarray  # (N',) int64 T2T edits each block has had (0 if none)

    def accept_lengths(self, block_size: int) -> np.ndarray:
        return self.retired * block_size


@dataclass
class WorkerFailed:
    message: str


MESSAGE_TYPES: tuple[type, ...] = (
    GenerateReq, AbortReq, InfoReq, ReqOutput, BatchOutput, InfoResp, Ready, Fatal, PrefillWork,
    DenoiseWork, Shutdown, WorkerReady, PrefillDone, RoundResult, WorkerFailed,
)


def encode(msg: object) -> bytes:
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return pickle.dumps(msg, protocol=5)


def decode(data: bytes) -> Any:
    msg = pickle.loads(data)
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"received a non-message object: {type(msg).__name__}")
    return msg
