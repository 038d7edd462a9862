"""Bucketed static forwards, and CUDA graphs of them: the base of prefill and denoise forwards.

`BucketedForwards` owns the static metadata (graph_layout.py: written on the host by a
`MetaWriter`, staged in the pinned ring of utils/device.py, one device buffer, one
host-to-device copy per forward whose metadata changed; the worker's denoise forwards compute
theirs on the device instead, model/denoise_graphs.py) and one
`StaticForward` per bucket: a ForwardBatch over prefixes of the static buffers with a fixed
attention plan, so each bucket launches the same kernels with the same arguments every time.
`capture` records each bucket's work in a CUDA graph (largest bucket first, after warm-up runs
on a side stream, every graph of the runner in one private memory pool: only one runs at a
time); `warm_up` runs each bucket's work once
instead, when graphs are off. Either way every Triton kernel a bucket needs is compiled before
the server is ready. Without either (the CPU) the same static forwards run eagerly: the tests
check padding and metadata that way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from dllm_serve.kernels.block_attention import TILE_FIELDS
from dllm_serve.kernels.triton_attention import TritonAttention
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.model.graph_layout import MetaLayout, MetaWriter
from dllm_serve.utils.device import copy_to_device

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2  # runs before a capture (compile, allocator, cuBLAS workspaces)


@dataclass
class StaticForward:
    """One bucket: its ForwardBatch over the static buffers, and its graphs once captured
    (`graph`: the forward; `step_graph`: the forward + the decoding step, denoise only;
    `open_graph`: the same with the step for when no row waits, gated denoise only)."""

    blocks: int
    fb: ForwardBatch
    token_slot: torch.Tensor  # (T_pad,) request slot of each token
    graph: torch.cuda.CUDAGraph | None = None
    step_graph: torch.cuda.CUDAGraph | None = None
    open_graph: torch.cuda.CUDAGraph | None = None

    @property
    def tokens(self) -> int:
        return self.fb.num_tokens


@dataclass
class GraphPool:
    """What every capture of one runner shares: the memory pool and the capture stream."""

    pool: object = field(default_factory=lambda: torch.cuda.graph_pool_handle())
    stream: torch.cuda.Stream = field(default_factory=torch.cuda.Stream)

    def capture(self, work: Callable[[], object]) -> torch.cuda.CUDAGraph:
        """Warm `work` up on the side stream, then record it in a graph."""
        side = self.stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                work()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):  # the warmed-up stream
            work()
        return graph


class BucketedForwards:
    """Static forwards at each of `buckets` (in blocks) over one packed metadata buffer; the
    base of PrefillGraphs and DenoiseGraphs. Invariant: every run of a bucket launches the
    same kernels with the same arguments (only buffer contents change)."""

    def __init__(self, model: nn.Module, kv: KVCache, attn: TritonAttention,
                 layout: MetaLayout, buckets: list[int], scratch_slot: int, pad_id: int,
                 ids: torch.Tensor | None) -> None:
        """ids: the static token ids (layout.max_tokens,) or more, or None when the layout
        carries them (prefill)."""
        self.model, self.kv, self.attn = model, kv, attn
        self.layout, self.buckets = layout, buckets
        self.scratch_slot, self.pad_id = scratch_slot, pad_id
        dev = kv.req_to_page.device
        self.meta = torch.zeros(layout.size, dtype=torch.int64, device=dev)
        self.writer = MetaWriter(layout, attn.tokens_per_tile, scratch_slot, pad_id)
        self.ids = self.field("ids", layout.max_tokens) if ids is None else ids.view(-1)
        self.forwards = {b: self._static_forward(b) for b in buckets}
        self.captured = False

    def field(self, name: str, size: int) -> torch.Tensor:
        start = self.layout.offset(name)
        return self.meta[start:start + size]

    def _static_forward(self, blocks: int) -> StaticForward:
        lay = self.layout
        k, t = lay.block_size, blocks * lay.block_size
        tiles = self.meta[lay.offset("tiles"):].view(torch.int32)
        tiles = tiles[:blocks * lay.tiles_per_block * TILE_FIELDS].view(-1, TILE_FIELDS)
        fb = ForwardBatch(
            input_ids=self.ids[:t], positions=self.field("positions", t),
            out_cache_loc=self.field("positions", t),  # replaced by `hidden`
            req_slots=self.field("seg_req", blocks),
            seg_starts=self.field("seg_starts", blocks), seg_lens=self.field("seg_lens", blocks),
            block_size=k, attn=self.attn, attn_meta=self.attn.static_plan(tiles, t, k))
        return StaticForward(blocks, fb, self.field("token_slot", t))

    def fill(self, bucket: int, req_slots: list[int], first_starts: list[int],
             num_blocks: list[int], ids: np.ndarray | None = None) -> None:
        """The metadata of one forward (padded to `bucket`), copied to the device unless it
        is already there (the writer's host copy mirrors `meta`)."""
        if self.writer.write(bucket, req_slots, first_starts, num_blocks, ids):
            copy_to_device(self.meta, self.writer.host)

    def hidden(self, static: StaticForward) -> torch.Tensor:
        """The bucket's model forward (KV slots of the tokens, then the layers) -> (T_pad,
        hidden)."""
        fb = static.fb
        fb.out_cache_loc = self.kv.slots(static.token_slot, fb.positions)
        return self.model(fb)

    def work(self, static: StaticForward) -> Callable[[], object]:
        """What a bucket's graph holds (subclasses: the forward and what follows it)."""
        return lambda: self.hidden(static)

    def warm_work(self, static: StaticForward) -> Callable[[], object]:
        """Everything a bucket may run (its warm-up compiles it all)."""
        return self.work(static)

    def run(self, static: StaticForward) -> None:
        if static.graph is not None:
            static.graph.replay()
        else:
            self.work(static)()

    # ---- startup ---------------------------------------------------------------------------

    def capture(self, graphs: GraphPool, max_blocks: int) -> None:
        """Capture the graph of every bucket up to max_blocks, largest first. Raises on
        failure (the caller then drops the graphs and warms up eagerly)."""
        for bucket in sorted((b for b in self.buckets if b <= max_blocks), reverse=True):
            static = self.forwards[bucket]
            self.fill_padding(bucket)
            static.graph = graphs.capture(self.work(static))
        self.captured = any(s.graph is not None for s in self.forwards.values())

    def warm_up(self) -> None:
        """Run the work of every bucket without a graph once: its kernels get compiled."""
        for bucket in sorted(self.buckets, reverse=True):
            static = self.forwards[bucket]
            if static.graph is None:
                self.fill_padding(bucket)
                self.warm_work(static)()

    def fill_padding(self, bucket: int) -> None:
        """A forward of pad blocks only (every write on the scratch page)."""
        pad = np.zeros(0, dtype=np.int64) if self.layout.with_ids else None
        self.fill(bucket, [], [], [], pad)

    def drop_graphs(self) -> None:
        for static in self.forwards.values():
            static.graph = static.step_graph = static.open_graph = None
        self.captured = False
