"""Host-to-device copies that never make the host wait for the device.

A plain `tensor.to("cuda")` from pageable memory waits until the copy has run, i.e. until
every kernel queued before it has finished: in the worker's loop, which keeps the next forward
queued while it does its bookkeeping, that would stall the host for a whole forward. `to_device`
stages through pinned memory and copies asynchronously, in stream order. The staging memory is
one pinned ring per device (`PinnedRing`): an array is copied into the ring's next free bytes
and the device copy reads from there; asking the caching host allocator for a fresh pinned
block per copy (`tensor.pin_memory()`) costs tens of microseconds, several times a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING_BYTES = 8 << 20  # per device; a forward stages a few kB
RING_PARTS = 4  # reuse is fenced per quarter of the ring
ALIGN = 64


class PinnedRing:
    """Pinned staging bytes handed out in order, wrapping around.

    Invariant: bytes are reused only after every copy that read them has run. The ring is cut
    into RING_PARTS parts; leaving a part records an event on the current stream (after the
    part's last copy), and entering a part waits for the event recorded when it was last left,
    one full lap earlier (in practice long done: a lap is hundreds of forwards). Arrays larger
    than a part fall back to a pinned block of their own."""

    def __init__(self, device: torch.device, size: int = RING_BYTES) -> None:
        self.device = device
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        self.host = self.buf.numpy()
        self.part = size // RING_PARTS
        self.current = 0  # the part being handed out
        self.pos = 0  # next free byte, within the current part (or at its end)
        self.fences: list[torch.cuda.Event | None] = [None] * RING_PARTS

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """A pinned tensor holding a copy of the (contiguous) array."""
        n = array.nbytes
        if n > self.part:
            return torch.from_numpy(array).pin_memory()
        start = self._reserve(n)  # the copy goes through the ring's numpy view: no torch op
        self.host[start:start + n] = array.reshape(-1).view(np.uint8)
        flat = self.buf[start:start + n].view(_TORCH_DTYPES[array.dtype])
        return flat if array.ndim == 1 else flat.view(array.shape)

    def _reserve(self, n: int) -> int:
        """The first byte of n free bytes (n <= one part), fenced against earlier copies."""
        if self.pos + n > (self.current + 1) * self.part:  # the rest is too small: next part
            self._leave(self.current)
            self.current = (self.current + 1) % RING_PARTS
            self._enter(self.current)
            self.pos = self.current * self.part
        start = self.pos
        self.pos = min(-(-(start + n) // ALIGN) * ALIGN, (self.current + 1) * self.part)
        return start

    def _leave(self, part: int) -> None:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.fences[part] = event

    def _enter(self, part: int) -> None:
        fence = self.fences[part]
        if fence is not None:
            fence.synchronize()
            self.fences[part] = None


_RINGS: dict[torch.device, PinnedRing] = {}
_TORCH_DTYPES = {np.dtype(d): t for d, t in (
    (np.int64, torch.int64), (np.int32, torch.int32), (np.float32, torch.float32),
    (np.float64, torch.float64), (np.bool_, torch.bool), (np.uint8, torch.uint8),
    (np.int16, torch.int16), (np.int8, torch.int8), (np.float16, torch.float16))}


def _ring(device: torch.device) -> PinnedRing:
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = PinnedRing(device)
    return ring


def to_device(array: np.ndarray | Sequence[int] | Sequence[float], device: torch.device,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """One host-to-device copy that does not wait for the device (pinned staging on CUDA)."""
    if not (isinstance(array, np.ndarray) and dtype is None):  # lists, or a cast first
        t = torch.from_numpy(array) if isinstance(array, np.ndarray) else torch.tensor(array)
        t = t if dtype is None else t.to(dtype)
        if device.type != "cuda":
            return t
        array = t.numpy()
    if device.type != "cuda":
        return torch.from_numpy(array)
    return _ring(device).stage(np.ascontiguousarray(array)).to(device, non_blocking=True)


def copy_to_device(dst: torch.Tensor, array: np.ndarray) -> None:
    """dst := array (same shape and dtype), in stream order, without the host waiting for the
    device (pinned staging on CUDA): one copy into a tensor that already exists, where
    `to_device` also allocates one."""
    if dst.device.type != "cuda":
        dst.copy_(torch.from_numpy(array))
        return
    dst.copy_(_ring(dst.device).stage(np.ascontiguousarray(array)), non_blocking=True)

