"""`ModelRunner`: the model, its KV memory and the attention backend on one device.

It runs prefill forwards and hands out repeatable denoise runs (`prepare_denoise`). With the
triton attention backend every forward is *bucketed*: padded to a size bucket
(model/buckets.py) and run over static buffers (model/prefill_graphs.py,
model/denoise_graphs.py, the latter over the worker's row storage and with its greedy step).
`warm_up`, called once by the worker before it reports ready, compiles every bucket's kernels
on CUDA: it captures CUDA graphs (triton attention and MoE, --disable-cuda-graph not set) or
runs each bucket once; so nothing compiles while serving. The torch attention backend runs
unpadded eager forwards. The KV pool keeps one page and one request slot past what the
scheduler is told of: padding blocks write there. Configuration comes in as one frozen
`RunnerConfig`, resolved by the parent process (engine_config.py).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from dllm_serve.layers.attention import ATTENTION_BACKENDS
from dllm_serve.layers.fused import set_kernel_backend
from dllm_serve.layers.moe import set_moe_backend
from dllm_serve.mem.kv_cache import KVCache, PageWrite
from dllm_serve.model.buckets import prefill_budget
from dllm_serve.model.config import RunnerConfig
from dllm_serve.model.denoise_run import DenoiseRun, Hook
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.model.loader import load_model, random_model
from dllm_serve.utils.device import to_device

if TYPE_CHECKING:
    from dllm_serve.model.cuda_graph import BucketedForwards
    from dllm_serve.model.denoise_graphs import DenoiseGraphs, Step
    from dllm_serve.model.prefill_graphs import PrefillGraphs

logger = logging.getLogger(__name__)

CPU_MAX_KV_TOKENS = 262144
Forward = Callable[[], torch.Tensor]  # -> logits (N * K, V) fp32, valid until the next call


def load_kernels() -> None:
    """Register the "triton" attention and MoE backends where Triton is installed."""
    if importlib.util.find_spec("triton") is not None:
        import dllm_serve.kernels  # noqa: F401


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, model: nn.Module | None = None) -> None:
        """`model`: an already built model (benchmarks: random weights at real shapes);
        default: load the checkpoint (or random weights with load_format "dummy")."""
        load_kernels()
        self.device = torch.device(cfg.device)
        self.dtype = getattr(torch, cfg.dtype)
        self.block_size = cfg.block_size
        torch.manual_seed(cfg.random_seed)
        if model is None:
            model = (random_model(cfg.model.hf, self.dtype, self.device, cfg.random_seed)
                     if cfg.load_format == "dummy"
                     else load_model(cfg.model, self.dtype, self.device))
        self.model = model
        set_moe_backend(self.model, cfg.moe_backend)
        set_kernel_backend(self.model, "triton" if cfg.attention_backend == "triton" else "torch")
        layers, heads, kv_heads, head_dim = self.model.kv_spec()
        self.page_size = cfg.page_size or cfg.block_size
        context = cfg.model.context_length(cfg.context_length)
        max_pages_per_req = -(-(context + self.block_size) // self.page_size)
        bytes_per_token = 2 * layers * kv_heads * head_dim * self.dtype.itemsize
        num_pages = self._num_pages(cfg, context, bytes_per_token)
        slots = cfg.max_running_requests + cfg.admit_ahead  # request slots (their page tables)
        self.kv = KVCache(layers, num_pages + 1, self.page_size, kv_heads, head_dim,
                          slots + 1, max_pages_per_req, self.dtype, self.device)
        self.scratch_slot = slots  # its one page: the last one
        self.kv.map_pages(self.scratch_slot, 0, np.array([num_pages]))
        self.attn = ATTENTION_BACKENDS.get(cfg.attention_backend)(
            self.kv, heads, head_dim, self.model.attn_scale)
        logger.info("KV pool: %d pages of %d tokens (%.1f MB) on %s", num_pages, self.page_size,
                    num_pages * self.page_size * bytes_per_token / 1e6, self.device)
        self.cfg = cfg
        self.prefill_graphs = self._prefill_graphs()
        self.graphs: DenoiseGraphs | None = None  # see warm_up
        self.before_denoise: Hook | None = None  # see warm_up
        self.warmup_s = 0.0

    @property
    def max_requests(self) -> int:
        """Most requests in the device batch at once (more may hold slots, waiting to join)."""
        return self.cfg.max_running_requests

    @property
    def graph_max_blocks(self) -> int:
        return self.cfg.graph_max_blocks if self._want_graphs() else 0

    @property
    def num_pages(self) -> int:
        """Pages the scheduler may hand out (the scratch page excluded)."""
        return self.kv.num_pages - 1

    @property
    def bucketed(self) -> bool:
        """Forwards padded to buckets over static buffers (the triton attention backend)."""
        return self.cfg.attention_backend == "triton"

    def _want_graphs(self) -> bool:
        cfg = self.cfg
        if not cfg.cuda_graphs or self.device.type != "cuda":
            return False
        if cfg.attention_backend != "triton" or cfg.moe_backend != "triton":
            logger.info("CUDA graphs need --attention-backend triton and --moe-backend triton; "
                        "forwards run eagerly")
            return False
        return True

    def _prefill_graphs(self) -> PrefillGraphs | None:
        if not self.bucketed:
            return None
        from dllm_serve.model.prefill_graphs import PrefillGraphs

        return PrefillGraphs(self.model, self.kv, self.attn, self.block_size,  # type: ignore[arg-type]
                             prefill_budget(self.cfg.chunked_prefill_size, self.block_size),
                             self.cfg.mask_id, self.scratch_slot)

    def warm_up(self, ids: torch.Tensor | None = None, step: Step | None = None,
                width: int = 0, before: Hook | None = None,
                row_keys: tuple[torch.Tensor, torch.Tensor] | None = None,
                replayed: Hook | None = None, open_step: Step | None = None) -> None:
        """Build the bucketed denoise forwards over the static token ids `ids` (the worker's
        row storage, (rows, K)) with the greedy `step` (bucket, HeadInput) -> readout (bucket,
        width) after the forward when given; then, on CUDA, compile every bucket's kernels,
        prefill and denoise: capture their CUDA graphs when the config asks for them (on a
        capture failure warn and run them eagerly), and run each bucket without a graph once.
        `before` runs first in every denoise forward from then on, bucketed (inside its graph)
        or eager (the worker's staged row writes). `row_keys`: the storage's row_req and
        row_start (one block per row): bucketed forwards then compute their metadata from them
        (DenoiseGraphs). `replayed`: called after each replay of a denoise graph. `open_step`:
        the greedy step for when no row waits for its predecessor (gated rows; its own graphs)."""
        self.before_denoise = before
        if not self.bucketed:
            return
        from dllm_serve.model.denoise_graphs import DenoiseGraphs

        start = time.perf_counter()
        rows = self.cfg.graph_max_blocks if ids is None else ids.shape[0]
        self.graphs = DenoiseGraphs(self.model, self.kv, self.attn, self.block_size,  # type: ignore[arg-type]
                                    rows, self.cfg.model.vocab_size, self.cfg.mask_id,
                                    self.scratch_slot, ids, step, width, before, row_keys,
                                    replayed, open_step)
        if self.device.type != "cuda":
            return  # nothing to compile (the interpreter), no graphs
        graphs = self._want_graphs() and self._capture()
        for forwards in self._bucketed():
            forwards.warm_up()
        # The compiles' garbage (much of it after a cold Triton cache), collected before
        # the replays: the first launch after that collection ran 2-3 ms of the worker's CPU
        # time. Left to the startup freeze (managers/procs.py), which runs after these
        # replays, it fell on the first prefill served (results/h200/gpupath/README.md,
        # session 33).
        gc.collect()
        assert self.prefill_graphs is not None
        self.prefill_graphs.replay_each()  # first launches (graph uploads) before ready
        self.graphs.reset_published()
        torch.cuda.synchronize()
        self.warmup_s = time.perf_counter() - start
        self._log_warm_up(graphs)

    def _bucketed(self) -> list[BucketedForwards]:
        return [f for f in (self.prefill_graphs, self.graphs) if f is not None]

    def _capture(self) -> bool:
        from dllm_serve.model.cuda_graph import GraphPool

        assert self.prefill_graphs is not None and self.graphs is not None
        try:
            pool = GraphPool()
            self.prefill_graphs.capture(pool, self.prefill_graphs.buckets[-1])
            self.graphs.capture(pool, self.cfg.graph_max_blocks)
            return True
        except Exception as e:  # a graph must never take the server down
            logger.warning("CUDA graph capture failed, forwards run eagerly (--disable-cuda-graph "
                           "silences this): %s: %s", type(e).__name__, e)
        for forwards in self._bucketed():
            forwards.drop_graphs()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return False

    def _log_warm_up(self, graphs: bool) -> None:
        assert self.prefill_graphs is not None and self.graphs is not None
        k, den = self.block_size, self.graphs
        captured = [b for b in den.buckets if den.forwards[b].graph is not None]
        how = (f"CUDA graphs for every prefill bucket and denoise buckets {captured}"
               + (" (forward + step)" if den.step is not None else "")
               if graphs else "no CUDA graphs: each bucket ran once")
        logger.info("warm-up and capture took %.1f s: prefill buckets %s tokens, denoise "
                    "buckets %s blocks; %s", self.warmup_s,
                    [b * k for b in self.prefill_graphs.buckets], den.buckets, how)

    def _num_pages(self, cfg: RunnerConfig, context: int, bytes_per_token: int) -> int:
        if cfg.max_total_tokens is not None:
            tokens = cfg.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.mem_fraction_static - (total - free)
            tokens = int(budget // bytes_per_token)
            if tokens <= 0:
                raise MemoryError("no GPU memory left for the KV pool after loading the model; "
                                  "raise --mem-fraction-static")
        else:
            tokens = min(cfg.max_running_requests * (context + self.block_size),
                         CPU_MAX_KV_TOKENS)
        return max(1, tokens // self.page_size)

    # ---- forwards ---------------------------------------------------------------------------

    @property
    def page_table(self) -> torch.Tensor:
        """The KV cache's page table (slots, entries); its last row is the scratch slot's."""
        return self.kv.req_to_page

    def add_pages(self, slot: int, first: int, pages: np.ndarray) -> None:
        """Map page-table entries [first, first + len(pages)) of the request in `slot`."""
        self.kv.map_pages(slot, first, pages)

    def add_pages_many(self, writes: list[PageWrite]) -> None:
        """Several `add_pages` (slot, first, pages) at once, in order: one copy to the device."""
        self.kv.map_pages_many(writes)

    @torch.inference_mode()
    def prefill(self, slots: list[int], seg_starts: list[int],
                token_ids: list[np.ndarray]) -> None:
        """One forward caching whole prompt blocks: row i's tokens at positions
        [seg_starts[i], seg_starts[i] + len(token_ids[i])) of the request in slots[i]; padded
        to its bucket (a graph replay when captured), else eager."""
        if self.prefill_graphs is not None and self.prefill_graphs.run_prefill(
                slots, seg_starts, token_ids):
            return
        ids = to_device(np.concatenate(token_ids).astype(np.int64), self.device)
        lens = [len(t) for t in token_ids]
        self.model(self._batch(ids, slots, seg_starts, lens, logits=False))

    def prepare_denoise(self, slots: list[int], first_starts: list[int],
                        num_blocks: list[int], block_ids: torch.Tensor) -> DenoiseRun:
        """The repeatable denoise run over the active blocks: request b's num_blocks[b] blocks
        from first_starts[b] (pages mapped), tokens `block_ids` (N, K) on the device, read as
        they are at each call (the algorithm edits them in place). Bucketed (CUDA graphs when
        captured) when a bucket holds the batch, else eager forwards. With a `before` hook
        (warm_up) an eager run's batch is made in its first call, after the hook: its KV slots
        and attention metadata read the page table, which the hook may write (the worker's
        staged page mappings)."""
        if self.graphs is not None:
            run = self.graphs.prepare(slots, first_starts, num_blocks, block_ids)
            if run is not None:
                return run
        before = self.before_denoise
        if before is None:
            return DenoiseRun(self.eager_forward(slots, first_starts, num_blocks, block_ids))
        forward: Forward | None = None

        def run() -> torch.Tensor:
            nonlocal forward
            before()
            if forward is None:
                forward = self.eager_forward(slots, first_starts, num_blocks, block_ids)
            return forward()

        return DenoiseRun(run)

    def resident_run(self, n: int, block_ids: torch.Tensor) -> DenoiseRun | None:
        """The denoise run over rows [0, n) of the worker's row storage (`block_ids` their ids)
        when the bucketed forwards compute their metadata from the storage rows and a bucket
        holds n: one per n, made once (it reads no host list); else None."""
        if self.graphs is None:
            return None
        return self.graphs.resident_run(n, block_ids)

    def eager_forward(self, slots: list[int], first_starts: list[int], num_blocks: list[int],
                      block_ids: torch.Tensor) -> Forward:
        """The denoise forward unpadded and eager (the reference of the bucketed path)."""
        return partial(self._logits, self.denoise_batch(slots, first_starts, num_blocks,
                                                        block_ids))

    def denoise_batch(self, slots: list[int], first_starts: list[int], num_blocks: list[int],
                      block_ids: torch.Tensor) -> ForwardBatch:
        """The eager ForwardBatch of a denoise forward; its input_ids is a view of block_ids."""
        k = self.block_size
        return self._batch(block_ids.view(-1), slots, first_starts, [n * k for n in num_blocks],
                           logits=True)

    def _batch(self, input_ids: torch.Tensor, slots: list[int], seg_starts: list[int],
               seg_lens: list[int], logits: bool) -> ForwardBatch:
        dev = self.device
        positions = np.concatenate([np.arange(s, s + n) for s, n in
                                    zip(seg_starts, seg_lens, strict=True)])
        meta = to_device(np.concatenate([positions, np.repeat(slots, seg_lens), slots, seg_starts,
                                         seg_lens]).astype(np.int64), dev)  # one copy
        t, s = len(positions), len(slots)
        pos, seg_slot = meta[:t], meta[t:2 * t]
        fb = ForwardBatch(
            input_ids=input_ids, positions=pos, out_cache_loc=self.kv.slots(seg_slot, pos),
            req_slots=meta[2 * t:2 * t + s], seg_starts=meta[2 * t + s:2 * t + 2 * s],
            seg_lens=meta[2 * t + 2 * s:],
            block_size=self.block_size, attn=self.attn,
            logits_index=torch.arange(len(positions), device=dev) if logits else None,
            seg_starts_cpu=list(seg_starts), seg_lens_cpu=list(seg_lens))
        self.attn.prepare(fb)
        return fb

    @torch.inference_mode()
    def _logits(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb)  # (T, hidden)
        return self.model.compute_logits(hidden[fb.logits_index])
