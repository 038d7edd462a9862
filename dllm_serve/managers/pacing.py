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
On auto both follow the moving average of the host's wait for a readout: multi-step goes to
two once it stays under WAIT_LOW_S (the readouts are there whenever the host comes for them:
the host is the bottleneck, as with a small model and many requests), depth once it stays under
WAIT_DEEP_S (the host's work takes all but a sliver of each forward, so an iteration that
retires and admits more than the average outlasts the forward queued behind it and the device
idles: run 64 of that README, the built-in model at 16 / 32 / 64 requests, FDFO, best of 2: depth
2 37,049 / 65,239 / 103,761 tok/s with idle 0.85 / 0.83 / 0.58%, depth 1 37,413 / 64,680 /
97,655 with 1.9-4.4 / 4.7-7.7 / 9.4-10.0%, the earlier auto, which stayed at 1 until the wait
fell under WAIT_LOW_S, 36,376 / 63,413 / 100,530 with up to 1.7 / 5.9 / 2.2%; run 65, against
depth 1 with sync interleaved: FDFO idle at 32 / 64 1.0-2.8 / 0.7-2.3% against 4.3-11.2 /
4.5-4.9%, tok/s of both modes within the spread); each goes back
to one once the wait exceeds WAIT_HIGH_S (the device is the bottleneck); hysteresis in
between. Depth 2 also needs long blocks: its extra forward per block
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

WAIT_LOW_S, WAIT_DEEP_S, WAIT_HIGH_S, WAIT_EMA = 5e-5, 2.5e-4, 1e-3, 0.2
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
        avg = self.wait_avg = self.wait_avg + WAIT_EMA * (wait - self.wait_avg)
        if self.auto_depth and self.block_forwards < DEEP_MIN_FORWARDS:
            self.depth = 1
        elif self.auto_depth:
            self.depth = _pick(avg, WAIT_DEEP_S, self.depth)
        if self.auto_steps:
            self.multi_step = _pick(avg, WAIT_LOW_S, self.multi_step)

    def retired(self, forwards: list[int]) -> None:
        """Blocks of these forward counts retired (auto depth weighs its extra forward by
        them)."""
        for f in forwards:
            self.block_forwards += BLOCK_EMA * (f - self.block_forwards)


def _pick(wait_avg: float, low: float, current: int) -> int:
    """2 under `low`, 1 over WAIT_HIGH_S, else `current` (hysteresis)."""
    return 2 if wait_avg < low else 1 if wait_avg > WAIT_HIGH_S else current
