"""CUDA graphs for denoise forwards: one graph per bucket, replayed for every forward.

`DenoiseGraphs` owns the static inputs (token ids, the packed metadata of graph_layout.py) and
the static output (fp32 logits, one buffer shared by every bucket), and one `StaticForward` per
bucket: a ForwardBatch over prefixes of those buffers with a fixed attention plan. `prepare`
picks the bucket of a batch, fills the metadata (one host-to-device copy) and returns the
forward to call; each call copies the batch's current block ids into the static ids (the
algorithm edits them in place between forwards) and replays the bucket's graph. FDFO re-loops
and wavefront layout changes simply call again: the same bucket replays the same graph.

The graph holds the model forward and the logits, not the algorithm's step (whose state is
per round); the step runs eagerly on the graph's logits. Capture: largest bucket first, each
after warm-up runs on a side stream, all graphs in one private memory pool (only one runs at a
time). Without capture (`capture()` not called, e.g. on the CPU) the same static forward runs
eagerly: the tests check padding and metadata that way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dllm_serve.kernels.runtime import cdiv
from dllm_serve.kernels.triton_attention import TritonAttention
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.model.graph_layout import MetaLayout, fill_meta, graph_buckets, pick_bucket

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2


@dataclass
class StaticForward:
    """One bucket: its ForwardBatch over the static buffers, and its graph once captured."""

    blocks: int
    fb: ForwardBatch
    token_slot: torch.Tensor  # (T_pad,) request slot of each token
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def tokens(self) -> int:
        return self.fb.num_tokens


class DenoiseGraphs:
    def __init__(self, model: nn.Module, kv: KVCache, attn: TritonAttention, block_size: int,
                 max_blocks: int, vocab_size: int, pad_id: int, scratch_slot: int) -> None:
        self.model, self.kv, self.attn = model, kv, attn
        self.pad_id, self.scratch_slot = pad_id, scratch_slot
        self.buckets = graph_buckets(max_blocks)
        self.layout = MetaLayout(max_blocks, block_size, cdiv(block_size, attn.tokens_per_tile))
        dev = kv.req_to_page.device
        pin = dev.type == "cuda"
        self.host = torch.zeros(self.layout.size, dtype=torch.int64, pin_memory=pin)
        self.meta = torch.zeros(self.layout.size, dtype=torch.int64, device=dev)
        self.copied: torch.cuda.Event | None = None  # the last metadata copy (host buffer busy)
        self.ids = torch.full((self.layout.max_tokens,), pad_id, dtype=torch.int64, device=dev)
        self.logits = torch.zeros(self.layout.max_tokens, vocab_size, dtype=torch.float32,
                                  device=dev)
        self.forwards = {b: self._static_forward(b) for b in self.buckets}
        self.captured = False

    def _field(self, name: str, size: int) -> torch.Tensor:
        start = self.layout.offset(name)
        return self.meta[start:start + size]

    def _static_forward(self, blocks: int) -> StaticForward:
        k, lay = self.layout.block_size, self.layout
        t = blocks * k
        tiles = self.meta[lay.offset("tiles"):].view(torch.int32)
        tiles = tiles[:blocks * lay.tiles_per_block * 5].view(-1, 5)
        fb = ForwardBatch(
            input_ids=self.ids[:t], positions=self._field("positions", t),
            out_cache_loc=self._field("positions", t),  # replaced by _forward
            req_slots=self._field("seg_req", blocks),
            seg_starts=self._field("seg_starts", blocks), seg_lens=self._field("seg_lens", blocks),
            block_size=k, attn=self.attn,
            attn_meta=self.attn.static_plan(tiles, t, k))
        return StaticForward(blocks, fb, self._field("token_slot", t))

    # ---- per forward ---------------------------------------------------------------------

    def prepare(self, req_slots: list[int], first_starts: list[int], num_blocks: list[int],
                block_ids: torch.Tensor) -> Callable[[], torch.Tensor] | None:
        """The forward over the active blocks `block_ids` (N, K) (their pages mapped), or None
        when no bucket holds N blocks. Each call returns logits (N * K, V) fp32, valid until
        the next call."""
        n = block_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if bucket is None:
            return None
        static = self.forwards[bucket]
        self._fill(bucket, req_slots, first_starts, num_blocks)
        t = n * self.layout.block_size
        self.ids[t:static.tokens].fill_(self.pad_id)

        def run() -> torch.Tensor:
            self.ids[:t].copy_(block_ids.view(-1))
            self._run(static)
            return self.logits[:t]

        return run

    def _fill(self, bucket: int, req_slots: list[int], first_starts: list[int],
              num_blocks: list[int]) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # the previous copy still reads the host buffer
        fill_meta(self.host.numpy(), self.layout, bucket, req_slots, first_starts, num_blocks,
                  self.attn.tokens_per_tile, self.scratch_slot)
        self.meta.copy_(self.host, non_blocking=True)
        if self.meta.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def _run(self, static: StaticForward) -> None:
        if static.graph is not None:
            static.graph.replay()
        else:
            self._forward(static)

    def _forward(self, static: StaticForward) -> torch.Tensor:
        """The captured work: KV slots of the tokens, the model, the logits."""
        fb = static.fb
        fb.out_cache_loc = self.kv.slots(static.token_slot, fb.positions)
        hidden = self.model(fb)  # (T_pad, hidden)
        return self.model.compute_logits(hidden, out=self.logits[:static.tokens])

    # ---- capture --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graph (largest first) after warm-up runs; raises on failure
        (the caller falls back to eager forwards)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bucket in sorted(self.buckets, reverse=True):
            static = self.forwards[bucket]
            self._fill(bucket, [], [], [])  # all pad blocks: writes go to the scratch page
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_RUNS):
                    self._forward(static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):  # the warmed-up stream
                self._forward(static)
            static.graph = graph
        torch.cuda.synchronize()
        self.captured = True
        logger.info("captured %d CUDA graphs (buckets %s blocks) in %.1f s", len(self.buckets),
                    self.buckets, time.perf_counter() - start)
