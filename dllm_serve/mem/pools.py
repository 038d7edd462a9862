"""`IdPool`: a free list of integer ids (KV pages, request slots) that catches double frees."""

from __future__ import annotations

import numpy as np


class IdPool:
    """Ids 0..size-1. alloc takes the lowest free ids first; freeing an id not in use raises.
    The in-use flags are a bytearray: an admission or a release touches a few ids, where a
    Python loop over bytes costs less than numpy's per-call overhead."""

    def __init__(self, size: int, kind: str) -> None:
        self.size = size
        self.kind = kind
        self._free: list[int] = list(range(size - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._in_use = bytearray(size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"out of {self.kind}s: asked for {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._in_use[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        if not ids:
            return
        used = self._in_use
        for n, i in enumerate(ids):  # one pass: an id freed twice reads 0 the second time
            if not used[i]:
                for j in ids[:n]:  # undone: the pool is as it was
                    used[j] = 1
                raise RuntimeError(f"double free of {self.kind}(s) {sorted(ids)}")
            used[i] = 0
        self._free.extend(ids)

    def in_use(self) -> set[int]:
        return set(np.flatnonzero(np.frombuffer(self._in_use, dtype=np.uint8)).tolist())

    def check(self, owned: list[list[int]]) -> None:
        """Every id in use is owned exactly once, and free + used == size."""
        flat = [i for ids in owned for i in ids]
        if len(flat) != len(set(flat)):
            raise RuntimeError(f"{self.kind} owned twice: {sorted(_dups(flat))}")
        if set(flat) != self.in_use():
            leaked = sorted(self.in_use() - set(flat))
            stray = sorted(set(flat) - self.in_use())
            raise RuntimeError(f"{self.kind} pool inconsistent: leaked {leaked}, "
                               f"owned but free {stray}")
        if len(self._free) + len(flat) != self.size:
            raise RuntimeError(f"{self.kind} pool: free {len(self._free)} + used {len(flat)} "
                               f"!= total {self.size}")


def _dups(ids: list[int]) -> set[int]:
    seen: set[int] = set()
    return {i for i in ids if i in seen or seen.add(i)}  # type: ignore[func-returns-value]
