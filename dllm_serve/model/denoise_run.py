"""`DenoiseRun`: the prepared denoise forward of one batch layout (eager or CUDA graphs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

Hook = Callable[[], None]  # device work queued before every denoise forward (no host sync)


@dataclass
class DenoiseRun:
    """forward() -> logits (N * K, V) fp32 over the layout's blocks as they are then; step() ->
    the readout (N, width) of forward + the algorithm's greedy step replayed as one captured
    graph, or None when no step was captured for this layout. Outputs stay valid until the
    next call of either; on CUDA step()'s readout is a numpy view of pinned host memory
    written by the graph (kernels/host_copy.py `PublishRing`): read it once an event recorded
    after the call has completed (managers/readback.py). open_step() (gated rows only): the same
    as step() when the caller knows that no row waits for its predecessor (a cheaper step, its
    own graph); None where there is none."""

    forward: Callable[[], torch.Tensor]
    step: Callable[[], torch.Tensor | np.ndarray] | None = None
    open_step: Callable[[], torch.Tensor | np.ndarray] | None = None
