"""`WaitQueue`: the scheduler's requests waiting for admission, first come first served.

A deque removes a request from its middle by scanning it, and an abort looked for its request
by scanning the whole queue: a client that disconnects thousands of queued requests at once
(a load generator stopped mid-run) cost the scheduler time quadratic in the queue (8,000
aborts of 8,000 queued requests: 1.4 s on a 2-core CPU, the scheduler answering nothing else
meanwhile). Here every operation is O(1) (an abort: O(its matches)): the queue is an
insertion-ordered map by request identity, with an index of the requests by `rid` (several
live requests may share one only in tests; each is found).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from dllm_serve.managers.req import Req


class WaitQueue:
    def __init__(self) -> None:
        self._queue: OrderedDict[int, Req] = OrderedDict()  # id(req) -> req, arrival order
        self._by_rid: dict[str, dict[int, Req]] = {}

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._queue.values())

    def append(self, req: Req) -> None:
        self._queue[id(req)] = req
        self._by_rid.setdefault(req.rid, {})[id(req)] = req

    def head(self) -> Req:
        """The oldest request (IndexError when empty)."""
        for req in self._queue.values():
            return req
        raise IndexError("the wait queue is empty")

    def popleft(self) -> Req:
        """Remove and return the oldest request."""
        return self._forget(self._queue.popitem(last=False)[1])

    def pop(self) -> Req:
        """Remove and return the newest request."""
        return self._forget(self._queue.popitem(last=True)[1])

    def remove(self, req: Req) -> None:
        self._forget(self._queue.pop(id(req)))

    def with_rid(self, rid: str | None) -> list[Req]:
        """The waiting requests whose rid is `rid`, oldest first."""
        return list(self._by_rid.get(rid, {}).values()) if rid is not None else []

    def _forget(self, req: Req) -> Req:
        same = self._by_rid[req.rid]
        del same[id(req)]
        if not same:
            del self._by_rid[req.rid]
        return req
