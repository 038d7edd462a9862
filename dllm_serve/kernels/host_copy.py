"""Pinned host memory read and written by kernels inside the forward's CUDA graph.

`PublishRing` (device -> host): the step's readout. `StageRing` (host -> device): the worker's
staged row writes (RowStorage's inbox).

Between two graph replays a `cudaMemcpyAsync` of a few kB to pinned memory held the stream for
about 9-10 us on an H200, against about 2.5-3 us for a kernel writing the same bytes through
the unified address space (benchmarks/host_copy_bench.py). Launched from Python, though, a
Triton kernel cost the host 35-40 us against 8-10 us for the copy; captured in the graph it
costs the host nothing. So the denoise graphs end with `PublishRing.publish`: a one-program
kernel that writes the readout into the next of a ring of pinned slots, chosen by a cursor
that lives on the device and that the kernel advances, so each replay of the same graph writes
the next slot. The host keeps the same count (`take`, one per replay) and reads the slot once
an event recorded after the replay has completed.

The same holds the other way: a `cudaMemcpyAsync` of the staged rows to the device before a
replay held the stream ~10-12 us against ~3-4 us for a kernel reading them, and costs the host a
call. `StageRing.post` writes a message into a pinned slot, tagged with the number of the fetch that
must take it (the next one the host queues); `fetch`, captured first in the forward's graph,
counts the fetches run on the device (its cursor) and copies the slot of fetch number `cursor`
into the device buffer when its tag is that number, else only zeroes the buffer's count
(nothing new: a replay with no layout change). The tag keeps a forward queued before the post
(still waiting on the device when the host posts for the next one) from taking a message that
is not its own. The host counts the fetches it queues, eager or replayed.

Invariants (PublishRing): every `publish` that runs (replayed, or eager) is matched by one
`take`, in order, after `reset` (which the runner calls once its warm-up and captures, which run
publishes of their own, are done); at most `slots` publishes are unread at any time (the worker
has its pipeline depth + forwards per pass in flight, 4 at most). Pinned host memory is mapped
into the device's address space under CUDA's unified addressing, so the kernel writes it by its
host pointer; the host reads it through a numpy view (`take`).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

BLOCK = 1024  # int64 values a loop step


class PublishRing:
    def __init__(self, rows: int, width: int, device: torch.device, slots: int = 8) -> None:
        """`slots` pinned (rows, width) int64 host buffers and the device cursor (on the CPU,
        under Triton's interpreter, plain host memory: the tests' path)."""
        self.slots, self.rows, self.width = slots, rows, width
        self.host = torch.zeros(slots, rows, width, dtype=torch.int64,
                                pin_memory=device.type == "cuda")
        self.np = self.host.numpy()  # the host's view (a numpy slice costs no torch dispatch)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.next = 0  # the host's count of publishes taken

    def publish(self, src: torch.Tensor) -> None:
        """Queue: slot (cursor % slots)[:n] := src (n, width) int64 contiguous, cursor += 1.
        Capturable: a replay reads the cursor when it runs."""
        n = src.shape[0]
        assert src.shape[1] == self.width and n <= self.rows and src.is_contiguous()
        _publish_kernel[(1,)](src, self.host, self.cursor, n * self.width,
                              self.rows * self.width, SLOTS=self.slots, BLOCK=BLOCK,
                              num_warps=4)

    def take(self, n: int) -> np.ndarray:
        """The host view (n, width) of the slot the next unread publish writes (valid once
        that publish has run: wait for an event recorded after it)."""
        slot = self.next % self.slots
        self.next += 1
        return self.np[slot, :n]

    def reset(self) -> None:
        """Cursor and count back to 0 (the device idle: after warm-up and capture)."""
        if self.cursor.is_cuda:
            torch.cuda.synchronize(self.cursor.device)
        self.cursor.zero_()
        self.next = 0


class StageRing:
    def __init__(self, elems: int, width: int, device: torch.device, slots: int = 8) -> None:
        """`slots` pinned messages of up to `elems` int64 values, each after its tag (-1:
        never written), and the device cursor: the number of fetches run. A message is a count
        c and then c records of `width` values; its tag is the number of the fetch that must
        take it, `queued` when posted (the next fetch queued). Invariants (the caller's): at
        most one message per fetch; `queued` counts every fetch queued (`fetch` called eagerly
        counts itself; a replay of a graph holding a fetch: `replayed`).

        A slot is written again only once the fetch of the message it held has run: known
        from `ran` (the caller saw a later point of the stream complete: the worker's readouts)
        without a device call, else waited for through the slot's fence, an event recorded
        after that fetch was queued (one event per slot, recorded again each time: no event
        is created per message)."""
        self.slots, self.elems, self.width = slots, elems, width
        self.host = torch.full((slots, 1 + elems), -1, dtype=torch.int64,
                               pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)
        self.queued = 0  # fetches queued so far (the device's cursor, in stream order)
        self.done = 0  # fetches known to have run on the device (`ran`)
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self.unfenced: list[int] = []  # slots posted whose fetch was not yet queued
        self.fences = [torch.cuda.Event() for _ in range(slots)] if self.cuda else []
        self.fenced = [False] * slots  # the slot's fence stands for its message's fetch
        self.tags = [-1] * slots  # the tag of each slot's last message
        self.last_tag = -1

    def post(self, message: np.ndarray) -> None:
        """Write message (n,) int64, n <= elems, for the next fetch queued."""
        n, tag = message.shape[0], self.queued
        assert n <= self.elems and tag > self.last_tag, "one message per fetch"
        for slot in self.unfenced:  # their fetches are queued now: mark where they end
            if self.cuda:  # (the CPU: run already)
                self.fences[slot].record(self.stream)
                self.fenced[slot] = True
        self.unfenced = []
        slot = tag % self.slots
        if self.fenced[slot] and self.tags[slot] >= self.done:  # its fetch may not have run
            self.fences[slot].synchronize()
        self.fenced[slot] = False
        self.np[slot, 1:1 + n] = message
        self.np[slot, 0] = tag  # the tag last: a fetch that sees it sees the message
        self.tags[slot] = self.last_tag = tag
        self.unfenced.append(slot)

    def ran(self, fetches: int) -> None:
        """The first `fetches` fetches have run on the device (the caller waited for a point
        of the stream after the last of them was queued)."""
        self.done = max(self.done, fetches)

    def fetch(self, dst: torch.Tensor) -> None:
        """Queue: if the slot of fetch number `cursor` holds its message, dst[:1 + c * w] :=
        the message (c its count, w = `width`), else dst[0] := 0 (no records); then cursor
        += 1. Capturable (a replay reads the cursor and the tag when it runs; count it with
        `replayed`)."""
        assert dst.dtype == torch.int64 and dst.is_contiguous() and dst.numel() >= self.elems
        _fetch_kernel[(1,)](self.host, self.cursor, dst, 1 + self.elems, WIDTH=self.width,
                            SLOTS=self.slots, BLOCK=BLOCK, num_warps=4)
        if not (self.cuda and torch.cuda.is_current_stream_capturing()):
            self.queued += 1

    def replayed(self) -> None:
        """A graph holding one fetch was replayed: count it."""
        self.queued += 1


@triton.jit(do_not_specialize=["n"])
def _publish_kernel(Src, Host, Cursor, n, slot_elems, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    cursor = tl.load(Cursor)
    dst = Host + (cursor % SLOTS) * slot_elems
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(dst + i, tl.load(Src + i, mask=ok), mask=ok)
    tl.store(Cursor, cursor + 1)


@triton.jit
def _fetch_kernel(Host, Cursor, Dst, slot_elems, WIDTH: tl.constexpr, SLOTS: tl.constexpr,
                  BLOCK: tl.constexpr):
    cursor = tl.load(Cursor)
    src = Host + (cursor % SLOTS) * slot_elems  # [tag, count, records...]
    if tl.load(src) == cursor:
        n = 1 + tl.load(src + 1) * WIDTH
        for start in range(0, n, BLOCK):
            i = start + tl.arange(0, BLOCK)
            ok = i < n
            tl.store(Dst + i, tl.load(src + 1 + i, mask=ok), mask=ok)
    else:
        tl.store(Dst, cursor * 0)
    tl.store(Cursor, cursor + 1)
