"""`SchedulerConfig`: what the scheduler process needs, resolved once in the parent."""

from __future__ import annotations

from dataclasses import dataclass

LOOKAHEAD_BLOCKS = 4  # blocks mapped past the window the worker may open (topped up at half)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int
    mask_id: int
    fdfo: bool
    max_running_requests: int
    max_queued_requests: int | None
    chunked_prefill_size: int
    num_pages: int
    page_size: int
    random_seed: int = 0
    wavefront_size: int = 1
    radix_cache: bool = True
    admit_ahead: int = 0  # requests admitted past max_running_requests (see Scheduler._admit)

    @property
    def max_admitted(self) -> int:
        """Requests holding a slot at once: the running batch and those admitted ahead."""
        return self.max_running_requests + self.admit_ahead

    def __post_init__(self) -> None:
        if self.page_size % self.block_size:
            raise ValueError(f"--page-size ({self.page_size}) must be a multiple of the "
                             f"model's block size ({self.block_size})")
        if self.max_queued_requests is not None and self.admit_ahead > self.max_queued_requests:
            raise ValueError(f"admit_ahead ({self.admit_ahead}) must not exceed "
                             f"max_queued_requests ({self.max_queued_requests}): requests "
                             f"admitted ahead count as queued")

    @property
    def mapped_blocks(self) -> int:
        """Blocks past a request's committed end whose pages stay mapped: the W-block window,
        one spawned in the forward where the leftmost retires, and the lookahead."""
        return self.wavefront_size + 1 + LOOKAHEAD_BLOCKS
