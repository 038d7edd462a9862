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
    pass


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
    blocks: int = 0  # committed generation blocks
    block_forwards: list[int] = field(default_factory=list)  # per block; sent with the last output


@dataclass
class BatchOutput:
    outputs: list[ReqOutput]


@dataclass
class InfoResp:
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
    """One block per row, at absolute position block_starts[i]."""

    req_slots: list[int]
    pages: list[np.ndarray]
    block_starts: list[int]
    block_ids: np.ndarray  # (B, K) int64
    states: list[dict[str, np.ndarray] | None]  # None: the block starts now
    block_steps: np.ndarray  # (B,) int64 forwards each block has had
    temperatures: list[float]
    top_ps: list[float]
    seeds: list[int]
    params: list[dict[str, float]]  # per-request algorithm overrides
    fdfo: bool = True


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
    block_ids: np.ndarray  # (B, K) int64, as the last step left them
    done: np.ndarray  # (B,) bool: committed this round (accept_length = block_size)
    states: list[dict[str, np.ndarray] | None]  # None for done rows
    block_steps: np.ndarray  # (B,) int64
    forwards: int  # forwards run this round (every row took part in each)
    finished_at: np.ndarray  # (B,) forward at which each row finished, 0 if not

    def accept_lengths(self, block_size: int) -> np.ndarray:
        return np.where(self.done, block_size, 0)


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
