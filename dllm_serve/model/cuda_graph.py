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
from dllm_serve.model.denoise_run import DenoiseRun
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.model.graph_layout import MetaLayout, fill_meta, graph_buckets, pick_bucket

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2


Step = Callable[[int, torch.Tensor], torch.Tensor]  # (bucket, logits) -> readout (bucket, W)


@dataclass
class StaticForward:
    """One bucket: its ForwardBatch over the static buffers, and its graphs once captured
    (the forward; the forward + step)."""

    blocks: int
    fb: ForwardBatch
    token_slot: torch.Tensor  # (T_pad,) request slot of each token
    graph: torch.cuda.CUDAGraph | None = None
    step_graph: torch.cuda.CUDAGraph | None = None

    @property
    def tokens(self) -> int:
        return self.fb.num_tokens




class DenoiseGraphs:
    def __init__(self, model: nn.Module, kv: KVCache, attn: TritonAttention, block_size: int,
                 max_blocks: int, vocab_size: int, pad_id: int, scratch_slot: int,
                 ids: torch.Tensor | None = None, step: Step | None = None,
                 width: int = 0) -> None:
        """ids: the static token ids, (rows, K) with rows >= max_blocks (the worker's row
        storage); default: a buffer of the graphs' own. step: the greedy step to run after the
        forward, (bucket, logits) -> readout (bucket, width)."""
        self.model, self.kv, self.attn = model, kv, attn
        self.pad_id, self.scratch_slot = pad_id, scratch_slot
        self.buckets = graph_buckets(max_blocks)
        self.layout = MetaLayout(max_blocks, block_size, cdiv(block_size, attn.tokens_per_tile))
        dev = kv.req_to_page.device
        pin = dev.type == "cuda"
        self.host = torch.zeros(self.layout.size, dtype=torch.int64, pin_memory=pin)
        self.meta = torch.zeros(self.layout.size, dtype=torch.int64, device=dev)
        self.copied: torch.cuda.Event | None = None  # the last metadata copy (host buffer busy)
        if ids is None:
            ids = torch.full((max_blocks, block_size), pad_id, dtype=torch.int64, device=dev)
        assert ids.shape[0] >= max_blocks and ids.is_contiguous()
        self.ids = ids.view(-1)
        self.logits = torch.zeros(self.layout.max_tokens, vocab_size, dtype=torch.float32,
                                  device=dev)
        self.step = step
        self.readout = torch.zeros(max_blocks, width, dtype=torch.int64, device=dev)
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
                block_ids: torch.Tensor) -> DenoiseRun | None:
        """The run over the active blocks `block_ids` (N, K) (their pages mapped), or None
        when no bucket holds N blocks. forward() returns logits (N * K, V) fp32 and step() the
        readout (N, width), each valid until the next call."""
        n = block_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if bucket is None:
            return None
        static = self.forwards[bucket]
        self._fill(bucket, req_slots, first_starts, num_blocks)
        t = n * self.layout.block_size
        self.ids[t:static.tokens].fill_(self.pad_id)
        resident = block_ids.data_ptr() == self.ids.data_ptr()

        def forward() -> torch.Tensor:
            if not resident:
                self.ids[:t].copy_(block_ids.view(-1))
            self._run(static)
            return self.logits[:t]

        def step() -> torch.Tensor:
            if static.step_graph is not None:
                static.step_graph.replay()
            else:
                self._forward_step(static, bucket)
            return self.readout[:n]

        return DenoiseRun(forward, step if self.step is not None and resident else None)

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
        """Capture every bucket's graphs (largest first) after warm-up runs: the forward, and
        with a step the forward followed by the step. Raises on failure (the caller falls back
        to eager forwards)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for bucket in sorted(self.buckets, reverse=True):
            static = self.forwards[bucket]
            self._fill(bucket, [], [], [])  # all pad blocks: writes go to the scratch page
            static.graph = self._capture(lambda s=static: self._forward(s), pool, side)
        if self.step is not None:
            self._capture_steps(pool, side)
        torch.cuda.synchronize()
        self.captured = True
        logger.info("captured %d CUDA graphs (buckets %s blocks%s) in %.1f s",
                    len(self.buckets) * (2 if self.step else 1), self.buckets,
                    ", forward and forward + step" if self.step else "",
                    time.perf_counter() - start)

    def _capture_steps(self, pool: object, side: torch.cuda.Stream) -> None:
        """The forward + step graphs; if the step cannot be captured, warn and keep only the
        forward graphs (the step then runs eagerly on their logits)."""
        try:
            for bucket in sorted(self.buckets, reverse=True):
                static = self.forwards[bucket]
                self._fill(bucket, [], [], [])
                static.step_graph = self._capture(
                    lambda s=static, b=bucket: self._forward_step(s, b), pool, side)
        except Exception as e:
            logger.warning("the decoding step could not be captured in a CUDA graph (%s: %s); "
                           "it runs eagerly after the forward graphs", type(e).__name__, e)
            torch.cuda.synchronize()
            self.step = None
            for static in self.forwards.values():
                static.step_graph = None

    def _forward_step(self, static: StaticForward, bucket: int) -> None:
        assert self.step is not None
        logits = self._forward(static)
        self.readout[:bucket].copy_(self.step(bucket, logits[:bucket * self.layout.block_size]))

    def _capture(self, work: Callable[[], object], pool: object,
                 side: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                work()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):  # the warmed-up stream
            work()
        return graph
