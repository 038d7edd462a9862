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

    def __post_init__(self) -> None:
        if self.page_size % self.block_size:
            raise ValueError(f"--page-size ({self.page_size}) must be a multiple of the "
                             f"model's block size ({self.block_size})")

    @property
    def mapped_blocks(self) -> int:
        """Blocks past a request's committed end whose pages stay mapped: the W-block window,
        one spawned in the forward where the leftmost retires, and the lookahead."""
        return self.wavefront_size + 1 + LOOKAHEAD_BLOCKS
