"""Stop-string helpers shared by the scheduler (finding) and the front (truncating)."""

from __future__ import annotations


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string in text: (index, stop), or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string.

    Streaming holds that suffix back: the next block may complete the stop string.
    """
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
