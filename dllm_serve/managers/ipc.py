"""Typed ZMQ channels over ipc:// sockets (PUSH/PULL pairs; the receiving side binds)."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import zmq

from dllm_serve.managers.messages import decode, encode


@dataclass(frozen=True)
class Addresses:
    """The four one-way channels of a process set."""

    to_scheduler: str
    to_front: str
    to_worker: str
    from_worker: str

    @staticmethod
    def fresh() -> Addresses:
        base = tempfile.mkdtemp(prefix="dllm-serve-")
        return Addresses(*(f"ipc://{os.path.join(base, n)}" for n in
                           ("to_scheduler", "to_front", "to_worker", "from_worker")))

    def remove(self) -> None:
        """Remove the folder of the sockets (`fresh`'s): once every process that binds them
        is gone."""
        shutil.rmtree(os.path.dirname(self.to_scheduler[len("ipc://"):]), ignore_errors=True)


class Sender:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(addr)

    def send(self, msg: object) -> None:
        self.sock.send(encode(msg), copy=False)


class Receiver:
    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """Next message; None if none arrived within timeout_ms (None: wait forever)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return decode(self.sock.recv(copy=False).buffer)

    def drain(self, limit: int | None = None) -> list[Any]:
        """The messages already queued (at most `limit` of them), without waiting."""
        out = []
        while (limit is None or len(out) < limit) and self.sock.poll(0):
            out.append(decode(self.sock.recv(copy=False).buffer))
        return out
