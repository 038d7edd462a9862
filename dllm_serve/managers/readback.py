"""`Readback`: copy a step's readout to the host without making the host wait for it.

On CUDA the copy goes into one of a ring of pinned buffers (forwards are launched before the
previous ones' readouts are read: the worker's pipeline depth + forwards per pass in flight at
most) and an event, from a ring of as many, marks its end; `Pending.get` waits for that event
only. On the CPU the readout is copied at once (it may live in a
static buffer that the next forward, launched before it is read, rewrites).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Pending:
    array: np.ndarray  # host (n, width) int64, written once `event` has completed
    event: torch.cuda.Event | None

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def get(self) -> np.ndarray:
        """The readout (n, width), waiting for the copy if it is still running."""
        if self.event is not None:
            self.event.synchronize()
        return self.array


class Readback:
    def __init__(self, device: torch.device, buffers: int = 2) -> None:
        """buffers: readouts in flight at most (the worker's pipeline depth + forwards per pass)."""
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.count = buffers
        self.buffers: list[torch.Tensor] = []
        self.arrays: list[np.ndarray] = []  # their numpy views
        self.turn = 0
        # events re-recorded in turn (creating one per start costs the host a CUDA call): a
        # start's event is recorded again `buffers` starts later, when it has been read
        self.events = [torch.cuda.Event() for _ in range(buffers)] if self.cuda else []
        self.event_turn = 0

    def start(self, readout: torch.Tensor | np.ndarray) -> Pending:
        """Begin copying readout (n, width) int64 to the host; a readout already in pinned
        host memory (a numpy view of what the forward's graph writes there,
        kernels/host_copy.py) only gets its event. At most `buffers` started and unread."""
        host = isinstance(readout, np.ndarray)
        if not self.cuda:  # a copy: the readout may be a static buffer the next step rewrites
            return Pending((readout if host else readout.numpy()).copy(), None)
        if host:  # already bound for the host (a graph's PublishRing)
            return Pending(readout, self._event())
        n, width = readout.shape
        self.turn = (self.turn + 1) % self.count
        if len(self.buffers) < self.count or self.buffers[self.turn].shape[0] < n \
                or self.buffers[self.turn].shape[1] != width:
            self._grow(max(n, 64), width)
        self.buffers[self.turn][:n].copy_(readout, non_blocking=True)
        return Pending(self.arrays[self.turn][:n], self._event())

    def _event(self) -> torch.cuda.Event:
        """The next event of the ring, recorded now on the stream."""
        event = self.events[self.event_turn]
        self.event_turn = (self.event_turn + 1) % self.count
        event.record(self.stream)
        return event

    def _grow(self, rows: int, width: int) -> None:
        """Pinned buffers of 2 * rows rows, and their numpy views (made once: a tensor's
        .numpy() is four dispatched torch calls)."""
        torch.cuda.synchronize()  # a copy into the old buffers may still be running
        self.buffers = [torch.empty((2 * rows, width), dtype=torch.int64, pin_memory=True)
                        for _ in range(self.count)]
        self.arrays = [b.numpy() for b in self.buffers]
