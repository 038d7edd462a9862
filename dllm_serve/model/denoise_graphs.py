"""Denoise forwards at a bucket of active blocks: padded, warmed up or captured at startup.

`DenoiseGraphs` adds to the bucketed forwards (cuda_graph.py) the static input ids (the
worker's row storage: the batch's blocks live in rows [0, N)), the static output (fp32 logits,
one buffer shared by every bucket) and, when the worker gives one, its greedy step: each
bucket then has two graphs, the forward, and the forward followed by the step (which gets the
forward's `HeadInput`, model/head.py, instead of its logits; its readout
(bucket, width) in a static buffer, and on CUDA also written to pinned host memory by the graph
itself: kernels/host_copy.py). A worker whose rows may wait for their predecessor (gated
spawning, dllm/wavefront.py) also gives the step for when none waits (`open_step`: no gate
test, nothing held): each bucket then has a third graph, the forward and that step, which the
worker replays while it knows every gate open. `prepare` picks the bucket of a batch, fills
the metadata (one host-to-device copy; none when the worker's row storage gives its rows'
request keys and starts: then each forward computes its metadata first, on the device,
kernels/row_meta.py) and returns the run; each call copies the batch's current block ids
into the static ids when they are not already there and replays the bucket's graph (or runs
the same work eagerly: buckets past --cuda-graph-max-bs, graphs off). FDFO re-loops and
wavefront layout changes simply call again: the same bucket replays the same graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from dllm_serve.kernels.block_attention import TILE_FIELDS
from dllm_serve.kernels.host_copy import PublishRing
from dllm_serve.kernels.row_meta import RowMetaFields, write_row_meta, write_row_meta_reference
from dllm_serve.kernels.runtime import cdiv
from dllm_serve.kernels.triton_attention import TritonAttention
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.buckets import denoise_buckets, pick_bucket
from dllm_serve.model.cuda_graph import BucketedForwards, GraphPool, StaticForward
from dllm_serve.model.denoise_run import DenoiseRun, Hook
from dllm_serve.model.graph_layout import MetaLayout
from dllm_serve.model.head import HeadInput, Scores

logger = logging.getLogger(__name__)

Step = Callable[[int, Scores], torch.Tensor]  # (bucket, its HeadInput) -> readout (bucket, W)


class DenoiseGraphs(BucketedForwards):
    def __init__(self, model: nn.Module, kv: KVCache, attn: TritonAttention, block_size: int,
                 max_blocks: int, vocab_size: int, pad_id: int, scratch_slot: int,
                 ids: torch.Tensor | None = None, step: Step | None = None,
                 width: int = 0, before: Hook | None = None,
                 rows: tuple[torch.Tensor, torch.Tensor] | None = None,
                 replayed: Hook | None = None, open_step: Step | None = None) -> None:
        """ids: the static token ids, (rows, K) with rows >= max_blocks (the worker's row
        storage); default: a buffer of the graphs' own. step: the greedy step to run after the
        forward, (bucket, logits) -> readout (bucket, width). before: device work queued
        first in every forward (captured with it). rows: the storage's row_req and row_start
        (>= max_blocks,) when every row holds one block (a hole or padding: the scratch slot,
        start 0): each forward then computes its metadata from them, right after `before`,
        and `prepare` writes none (its batch must be the storage's rows). replayed: called
        after each replay of a graph (each holds `before`: the worker counts its fetches).
        open_step: the step when no row waits for its predecessor (same readout), or None."""
        dev = kv.req_to_page.device
        if ids is None:
            ids = torch.full((max_blocks, block_size), pad_id, dtype=torch.int64, device=dev)
        assert ids.shape[0] >= max_blocks and ids.is_contiguous()
        layout = MetaLayout(max_blocks, block_size, cdiv(block_size, attn.tokens_per_tile))
        super().__init__(model, kv, attn, layout, denoise_buckets(max_blocks), scratch_slot,
                         pad_id, ids)
        # the LM head writes its logits here in the model's dtype (no fp32 copy of a
        # (T, vocab) tensor per forward); the step reads them in fp32 (DllmAlgorithm.predict)
        self.logits = torch.zeros(layout.max_tokens, vocab_size,
                                  dtype=model.lm_head.weight.dtype, device=dev)
        self.step, self.open_step = step, open_step
        self.before = before  # first in every forward (the worker's staged row writes)
        self.replayed = replayed
        self.readout = torch.zeros(max_blocks, width, dtype=torch.int64, device=dev)
        # on CUDA the step's graph also writes its readout to pinned host memory (no copy
        # between replays); `reset_published` after warm-up
        self.published = (PublishRing(max_blocks, width, dev)
                          if step is not None and dev.type == "cuda" else None)
        self.rows = rows
        self.resident: dict[int, DenoiseRun | None] = {}  # resident_run's, by row count
        tiles = self.meta[layout.offset("tiles"):].view(torch.int32)
        self.row_fields = RowMetaFields(
            self.field("positions", layout.max_tokens), self.field("token_slot", layout.max_tokens),
            self.field("seg_req", max_blocks), self.field("seg_starts", max_blocks),
            tiles[:layout.max_tiles * TILE_FIELDS].view(-1, TILE_FIELDS))
        self.fill_padding(self.buckets[-1])  # the fields no row changes, for every bucket

    # ---- per forward ---------------------------------------------------------------------

    def prepare(self, req_slots: list[int], first_starts: list[int], num_blocks: list[int],
                block_ids: torch.Tensor) -> DenoiseRun | None:
        """The run over the active blocks `block_ids` (N, K) (their pages mapped), or None
        when no bucket holds N blocks. forward() returns logits (N * K, V) in the model's dtype
        and step() the readout (N, width), each valid until the next call (on CUDA in pinned
        host memory, written by the step's graph: read it after an event recorded after the
        call has completed; each step() must be read before `slots` more). With `rows` the
        lists are not read: the forward computes its metadata from the storage rows, which
        `block_ids` must be."""
        n = block_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if bucket is None:
            return None
        static = self.forwards[bucket]
        resident = block_ids.data_ptr() == self.ids.data_ptr()
        if self.rows is None:
            self.fill(bucket, req_slots, first_starts, num_blocks)
        else:
            assert resident, "with rows, a forward runs over the storage rows only"
        t = n * self.layout.block_size
        if not resident:  # resident rows past N hold earlier blocks' ids: valid tokens too
            self.ids[t:static.tokens].fill_(self.pad_id)

        def forward() -> torch.Tensor:
            if not resident:
                self.ids[:t].copy_(block_ids.view(-1))
            self.run(static)
            if static.graph is not None:
                self._replayed()
            return self.logits[:t]

        def step(gates_open: bool = False) -> torch.Tensor:
            graph = static.open_graph if gates_open else static.step_graph
            if graph is not None:
                graph.replay()
                self._replayed()
            else:
                self.forward_step(static, gates_open)
            return self.readout[:n] if self.published is None else self.published.take(n)

        if self.step is None or not resident:
            return DenoiseRun(forward)
        return DenoiseRun(forward, step, partial(step, True) if self.open_step else None)

    def resident_run(self, n: int, block_ids: torch.Tensor) -> DenoiseRun | None:
        """`prepare` over storage rows [0, n) (`block_ids`), made once per n, when the forwards
        compute their metadata from the storage rows (`rows`) and a bucket holds n; else
        None."""
        if self.rows is None or pick_bucket(n, self.buckets) is None:
            return None
        run = self.resident.get(n)
        if run is None:
            run = self.resident[n] = self.prepare([], [], [], block_ids)
        assert run is not None
        return run

    def _replayed(self) -> None:
        if self.replayed is not None:
            self.replayed()

    def head_of(self, static: StaticForward) -> HeadInput:
        """The bucket's forward up to its LM head: hidden (T_pad, hidden), whose logits()
        writes the logits (T_pad, V) in the model's dtype into the static buffer."""
        if self.before is not None:
            self.before()
        if self.rows is not None:
            meta = write_row_meta if self.meta.is_cuda else write_row_meta_reference
            meta(*self.rows, self.row_fields, static.blocks, self.layout.block_size)
        hidden = self.hidden(static)  # (T_pad, hidden)
        out = self.logits[:static.tokens]
        return HeadInput(hidden, self.model.lm_head.weight,
                         lambda: self.model.compute_logits(hidden, out=out))

    def logits_of(self, static: StaticForward) -> torch.Tensor:
        """The bucket's forward -> its logits (T_pad, V) in the static buffer."""
        return self.head_of(static).logits()

    def work(self, static: StaticForward) -> Callable[[], object]:
        return lambda: self.logits_of(static)

    def forward_step(self, static: StaticForward, gates_open: bool = False) -> None:
        """The forward, then the greedy step over storage rows [0, bucket), given the forward's
        HeadInput (a greedy step on CUDA then computes no logits tensor: kernels/lm_head.py);
        gates_open: `open_step` instead."""
        step = self.open_step if gates_open else self.step
        assert step is not None
        self.readout[:static.blocks].copy_(step(static.blocks, self.head_of(static)))
        if self.published is not None:
            self.published.publish(self.readout[:static.blocks])

    def reset_published(self) -> None:
        """Start the published readouts' count afresh (warm-up and capture ran publishes that
        no step() took)."""
        if self.published is not None:
            self.published.reset()

    # ---- startup ---------------------------------------------------------------------------

    def capture(self, graphs: GraphPool, max_blocks: int) -> None:
        """The forward graphs, then (with a step) the forward + step graphs, and (with an
        open_step) the forward + open step graphs; if a step cannot be captured, warn and keep
        only the forward graphs (the step then runs eagerly after them)."""
        super().capture(graphs, max_blocks)
        if self.step is None:
            return
        try:
            for bucket in sorted((b for b in self.buckets if b <= max_blocks), reverse=True):
                static = self.forwards[bucket]
                self.fill_padding(bucket)
                static.step_graph = graphs.capture(lambda s=static: self.forward_step(s))
                if self.open_step is not None:
                    static.open_graph = graphs.capture(
                        lambda s=static: self.forward_step(s, gates_open=True))
        except Exception as e:
            logger.warning("the decoding step could not be captured in a CUDA graph (%s: %s); "
                           "it runs eagerly after the forward graphs", type(e).__name__, e)
            torch.cuda.synchronize()
            self.step = self.open_step = None
            for static in self.forwards.values():
                static.step_graph = static.open_graph = None

    def warm_work(self, static: StaticForward) -> Callable[[], object]:
        if self.step is None:
            return self.work(static)

        def both() -> None:
            self.forward_step(static)
            if self.open_step is not None:
                self.forward_step(static, gates_open=True)
        return both
