"""Host-to-device copies that never make the host wait for the device.

A plain `tensor.to("cuda")` from pageable memory waits until the copy has run, i.e. until
every kernel queued before it has finished: in the worker's loop, which keeps the next forward
queued while it does its bookkeeping, that would stall the host for a whole forward. `to_device`
stages through pinned memory (PyTorch's caching host allocator keeps the staging block alive
until the copy has run) and copies asynchronously, in stream order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(array: np.ndarray | Sequence[int] | Sequence[float], device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """One host-to-device copy that does not wait for the device (pinned staging on CUDA)."""
    t = torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.tensor(array)
    if dtype is not None:
        t = t.to(dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def record_event(stream: torch.cuda.Stream, timing: bool = False) -> torch.cuda.Event:
    """A CUDA event recorded on `stream` (held by the caller: `Event.record()` without a stream
    asks torch.cuda.current_stream() each time, tens of microseconds of Python per call on the
    worker's per-forward path)."""
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event
