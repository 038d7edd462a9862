"""The worker's KV memory: per-layer K/V tensors addressed by slot, and the request page table.

Slot `s` holds the K/V of one token: page `s // page_size`, offset `s % page_size`. The token at
absolute position `p` of the request in row `r` lives in slot
`req_to_page[r, p // page_size] * page_size + p % page_size`. The scheduler decides which pages a
request owns (mem/allocator.py); the worker only writes the entries it is told.
"""

from __future__ import annotations

import numpy as np
import torch

from dllm_serve.utils.device import copy_to_device, to_device

PageWrite = tuple[int, int, np.ndarray]  # (slot, first entry, page ids)


def write_end(first: int, pages: np.ndarray, entries: int) -> int:
    """The entry after a write of `pages` from `first`; ValueError past a table of `entries`
    entries a slot."""
    end = first + len(pages)
    if end > entries:
        raise ValueError(f"request needs {end} pages, the table holds {entries}")
    return end


class KVCache:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, max_req_slots: int, max_pages_per_req: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_pages_per_req = max_pages_per_req
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # (max_req_slots, max_pages_per_req) page ids; -1 marks an unused entry.
        self.req_to_page = torch.full((max_req_slots, max_pages_per_req), -1, dtype=torch.int64,
                                      device=device)

    def map_pages(self, slot: int, first: int, pages: np.ndarray) -> None:
        """Write page-table entries [first, first + len(pages)) of request slot `slot`."""
        end = write_end(first, pages, self.max_pages_per_req)
        copy_to_device(self.req_to_page[slot, first:end], np.asarray(pages, dtype=np.int64))

    def map_pages_many(self, writes: list[PageWrite]) -> None:
        """Several `map_pages` in one host-to-device copy and one scatter (one copy each
        costs the worker tens of microseconds of host time per admitted request). Writes apply
        in order: where two write the same entry, the later one holds."""
        if len(writes) == 1:
            self.map_pages(*writes[0])
            return
        width = self.max_pages_per_req
        flat, vals = [], []
        for slot, first, pages in writes:
            end = write_end(first, pages, self.max_pages_per_req)
            flat.append(np.arange(slot * width + first, slot * width + end, dtype=np.int64))
            vals.append(np.asarray(pages, dtype=np.int64))
        index, value = np.concatenate(flat), np.concatenate(vals)
        if len({slot for slot, _, _ in writes}) < len(writes):  # entries may repeat: keep the
            # last write of each (a scatter with repeated indices keeps any one)
            last = len(index) - 1 - np.unique(index[::-1], return_index=True)[1]
            index, value = index[last], value[last]
        both = to_device(np.stack([index, value]), self.req_to_page.device)
        self.req_to_page.view(-1).index_copy_(0, both[0], both[1])

    def slots(self, req_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV slot of each absolute position; req_slots and positions broadcast together."""
        page = self.req_to_page[req_slots, positions // self.page_size]
        return page * self.page_size + positions % self.page_size
