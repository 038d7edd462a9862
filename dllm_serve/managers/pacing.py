"""`Pacing`: how far ahead of its bookkeeping the worker keeps the device (managers/worker.py).

Two knobs, each 1 or 2, fixed or chosen on auto (CUDA only; a CPU forward runs while it is
launched, so there is nothing to overlap):
- depth (--dllm-pipeline-depth; auto by default): forwards kept queued while the host reads
  the oldest back. With 2 the host's bookkeeping for forward k overlaps forwards k + 1 and
  k + 2, and a converged block takes part in one more forward before it leaves (a no-op: a
  step changes nothing in a block that is done on entry, and the reported forward count is
  its final one).
- multi_step (--dllm-multi-step; 1 by default: 2 and auto measured no reliably faster on an
  H200, runs 38-40 of benchmarks/results/h200/runtime/README.md): forwards launched over one
  layout per pass of the bookkeeping (vLLM's multi-step scheduling), so a host slower than the
  device pays its per-pass work (the layout patch, the scheduler's messages, the report) once
  per `multi_step` forwards. Every forward's readout is still read, so a block's final forward
  and its reported counts are unchanged, but a block that converges inside a pass leaves only
  after it (at most `multi_step` - 1 more no-op forwards) and new blocks join at the next pass.
On auto both follow the moving average of the host's wait for a readout: two once it stays
under WAIT_LOW_S (the readouts are there whenever the host comes for them: the host is the
bottleneck, as with a small model and many requests), one once it exceeds WAIT_HIGH_S (the
device is); hysteresis in between. Depth 2 also needs long blocks: its extra forward per block
delays each request's next block by one forward (1 / (F + 1) of its pace for blocks of F
forwards) against the idle it saves (5-11% on an H200 where the host is the bottleneck), so
auto keeps depth 1 while the moving average of the retired blocks' forwards is under
DEEP_MIN_FORWARDS. On an H200 (benchmarks/results/h200/runtime/README.md, runs 44-45), the
built-in model on GSM8K (26 forwards a block), FDFO: depth 2 against 1 -2.5% to +5.6% at 16
requests, +0.7% to +54% at 64 (the turns where depth 1's host stalled), idle 0.7-2.2% against
1.3-34%; on its held-out problems (3 forwards a block) depth 2 was 8% slower, and auto keeps 1
there. WAIT_HIGH_S is above a small model's whole forward (0.3-0.5 ms), so there auto, once at
2, stays at 2.
`overlap` (no knob: CUDA's) makes the worker launch before it applies the scheduler's costly
changes (prefills, preemptions; the cheap ones that come first still go before: worker.py
`iterate`), so their host work runs beside the queued forwards (on the CPU a forward runs
inside its launch: the changes come first, or an admission would wait one more forward for
nothing).
"""

from __future__ import annotations

WAIT_LOW_S, WAIT_HIGH_S, WAIT_EMA = 5e-5, 1e-3, 0.2
DEEP_MIN_FORWARDS, BLOCK_EMA = 16.0, 0.05


class Pacing:
    def __init__(self, depth: int | None, multi_step: int | None, cuda: bool) -> None:
        """depth / multi_step: 1 or 2, or None: auto on CUDA, 1 elsewhere."""
        # the device runs a launched forward while the host goes on (CUDA): the worker then
        # launches before it applies the scheduler's changes (managers/worker.py `iterate`)
        self.overlap = cuda
        self.auto_depth = depth is None and cuda
        self.auto_steps = multi_step is None and cuda
        self.depth = depth or 1
        self.multi_step = multi_step or 1
        self.wait_avg = WAIT_HIGH_S  # start at one forward ahead, one forward a pass
        self.block_forwards = 0.0  # moving average of the retired blocks' forwards

    @property
    def most_in_flight(self) -> int:
        """The most forwards this worker ever has launched and unread (its readback buffers)."""
        return ((2 if self.auto_depth else self.depth)
                + (2 if self.auto_steps else self.multi_step))

    def observe(self, wait: float) -> None:
        """The host waited `wait` seconds for a readout: on auto, pick the knobs again."""
        if not (self.auto_depth or self.auto_steps):
            return
        self.wait_avg += WAIT_EMA * (wait - self.wait_avg)
        pick = 2 if self.wait_avg < WAIT_LOW_S else 1 if self.wait_avg > WAIT_HIGH_S else None
        if self.auto_depth and self.block_forwards < DEEP_MIN_FORWARDS:
            self.depth = 1
        elif self.auto_depth and pick is not None:
            self.depth = pick
        if self.auto_steps and pick is not None:
            self.multi_step = pick

    def retired(self, forwards: list[int]) -> None:
        """Blocks of these forward counts retired (auto depth weighs its extra forward by
        them)."""
        for f in forwards:
            self.block_forwards += BLOCK_EMA * (f - self.block_forwards)
