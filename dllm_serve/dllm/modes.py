"""Execution modes, independent of the algorithm: when blocks retire and when blocks open.

- FDFO (first done, first out): a request retires its leading converged blocks as soon as they
  have had their final forward; their place is taken at once (the request's next block, or a
  new request's).
- sync: nothing retires until every request in the batch can retire its leftmost block; then
  every request retires its leading converged blocks together, and new work joins.
- wavefront (size W > 1, FlowBlock): a request may also open its next block before its
  frontier is done, when the frontier is ready (`WavefrontConfig` below; the readiness and the
  gates' mechanics in wavefront.py); lockstep (a benchmark baseline, sync only) opens blocks
  only when every request that could is ready, all together.
A request whose window empties opens its next block if it goes on (no stop token, pages mapped).
Blocks retire in order only, so a committed block's KV was computed from its final tokens and
its final left context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

CONVERGED, READY = 1, 2  # a row's flags after its step (RowStorage.flag), a gate's bits
# (kernels/readout.py writes a row's flags as converged | ready << 1: these very bits)


@dataclass(frozen=True)
class WavefrontConfig:
    size: int = 1  # W: most active blocks per request
    spawn_threshold: float = 0.6  # theta
    token_threshold: float | None = None  # tau; None: the algorithm's own threshold
    lockstep: bool = False  # baseline: every request spawns and retires together
    gated: bool = False  # W > 1: the next block waits in a row, opened on the device
    standby: bool = False  # FDFO, W = 1: the same (the successor waits for convergence)
    # gated / standby: place blocks ahead only while recent blocks averaged at most this many
    # forwards (inf: always)
    arm_forwards: float = 6.0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--dllm-wavefront-size must be >= 1, got {self.size}")
        if not 0.0 <= self.spawn_threshold <= 1.0:
            raise ValueError(f"--dllm-spawn-threshold must be in [0, 1], got "
                             f"{self.spawn_threshold}")
        tau = self.token_threshold
        if tau is not None and not 0.0 <= tau <= 1.0:
            raise ValueError(f"--dllm-spawn-token-threshold must be in [0, 1], got {tau}")
        if not self.arm_forwards >= 0.0:  # NaN fails too
            raise ValueError(f"--dllm-gate-arm-forwards must be >= 0 (inf: always), got "
                             f"{self.arm_forwards}")


@dataclass(frozen=True)
class RoundMode:
    fdfo: bool = True
    wavefront: WavefrontConfig = field(default_factory=WavefrontConfig)

    @property
    def gate(self) -> int:
        """The predecessor flags that open a gated row (wavefront.py: CONVERGED | READY with
        W > 1, FDFO or sync alike; CONVERGED with W = 1 standby, FDFO only: a sync batch starts
        no block before its boundary); 0: blocks open on the host only (lockstep, gating
        off)."""
        wf = self.wavefront
        if wf.lockstep:
            return 0
        if wf.size > 1:
            return CONVERGED | READY if wf.gated else 0
        return CONVERGED if wf.standby and self.fdfo else 0

    @property
    def rows_per_request(self) -> int:
        """Most rows a request holds: its window, and with W = 1 gated its successor's."""
        return self.wavefront.size + (self.gate != 0 and self.wavefront.size == 1)


@dataclass
class Plan:
    """Per request: retire[b] leading blocks leave now; open[b] one new block opens after the
    request's frontier (its window is empty, or its ready frontier spawns)."""

    retire: list[int]  # (B,)
    open: list[bool]  # (B,)
    boundary: bool  # sync: the whole batch retired (new requests may join)


def plan(mode: RoundMode, leading: Sequence[int], num_blocks: Sequence[int],
         frontier_ready: Sequence[bool], can_open: Sequence[bool],
         batch_done: bool | None = None) -> Plan:
    """leading (B,): converged blocks at the start of each request's window; num_blocks (B,);
    frontier_ready (B,): the frontier block is ready to spawn; can_open (B,): a block after the
    frontier fits (pages mapped, below max_end) and the request goes on. batch_done (sync):
    every request of the batch has a converged leftmost block (default: judged from these B
    requests, when they are the whole batch). Plain Python over the B requests: B is the few
    requests a readout changed, where numpy's per-call cost is several times the work."""
    if batch_done is None:
        batch_done = len(leading) > 0 and all(n > 0 for n in leading)
    boundary = not mode.fdfo and batch_done
    retiring = mode.fdfo or boundary
    if not mode.wavefront.lockstep:  # each request on its own
        each = [plan_one(mode, int(n), int(b), bool(r), bool(c), retiring)
                for n, b, r, c in zip(leading, num_blocks, frontier_ready, can_open, strict=True)]
        return Plan([r for r, _ in each], [o for _, o in each], boundary)
    # lockstep: all that may spawn are ready, or none spawns
    retire = [int(n) for n in leading] if retiring else [0] * len(leading)
    left = [int(n) - r for n, r in zip(num_blocks, retire, strict=True)]
    room = [0 < n < mode.wavefront.size and bool(c) for n, c in zip(left, can_open, strict=True)]
    go = any(room) and all(r for r, e in zip(frontier_ready, room, strict=True) if e)
    opens = [(n == 0 and bool(c)) or (e and go)
             for n, c, e in zip(left, can_open, room, strict=True)]
    return Plan(retire, opens, boundary)


def plan_one(mode: RoundMode, leading: int, num_blocks: int, frontier_ready: bool,
             can_open: bool, retiring: bool = True) -> tuple[int, bool]:
    """One request's (retire, open) where requests do not depend on each other (every mode
    but lockstep; FDFO's worker plans each request this way): its `leading` converged blocks
    retire when `retiring` (FDFO, or a sync batch's boundary); a block opens after the
    frontier if the window is then empty, or if the frontier is ready with room behind it in
    the window, and the block fits (`can_open`)."""
    retire = leading if retiring else 0
    left = num_blocks - retire
    return retire, can_open and (left == 0 or (left < mode.wavefront.size and frontier_ready))
