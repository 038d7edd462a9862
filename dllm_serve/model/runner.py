"""`ModelRunner`: the model, its KV memory and the attention backend on one device.

It turns scheduler work (PrefillWork / DenoiseWork) into `ForwardBatch`es and runs forwards.
A denoise batch's `input_ids` is a view of the round's block ids (B, K), so an algorithm that
edits the block ids in place changes what the next forward of the same batch sees.
On CUDA with the triton backends, denoise forwards replay CUDA graphs (model/cuda_graph.py)
captured here at startup; prefill stays eager. The KV pool keeps one page and one request slot
past what the scheduler is told of: the graphs' padding blocks write there.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.layers.attention import ATTENTION_BACKENDS
from dllm_serve.layers.fused import set_kernel_backend
from dllm_serve.layers.moe import set_moe_backend
from dllm_serve.managers.messages import PrefillWork
from dllm_serve.mem.kv_cache import KVCache
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.forward_batch import ForwardBatch
from dllm_serve.model.forward_timer import ForwardTimer
from dllm_serve.model.loader import load_model, random_model
from dllm_serve.server_args import ServerArgs

if TYPE_CHECKING:
    from dllm_serve.model.cuda_graph import DenoiseGraphs

logger = logging.getLogger(__name__)

CPU_MAX_KV_TOKENS = 262144


def load_kernels() -> None:
    """Register the "triton" attention and MoE backends where Triton is installed."""
    if importlib.util.find_spec("triton") is not None:
        import dllm_serve.kernels  # noqa: F401


class ModelRunner:
    def __init__(self, model_config: ModelConfig, dllm: DllmConfig, args: ServerArgs,
                 model: nn.Module | None = None) -> None:
        """`model`: an already built model (benchmarks: random weights at real shapes);
        default: load model_config's checkpoint."""
        load_kernels()
        self.device = torch.device(args.resolved_device)
        self.dtype = getattr(torch, args.resolved_dtype)
        self.block_size = dllm.block_size
        torch.manual_seed(args.random_seed)
        if model is None:
            model = (random_model(model_config.hf, self.dtype, self.device, args.random_seed)
                     if args.load_format == "dummy"
                     else load_model(model_config, self.dtype, self.device))
        self.model = model
        set_moe_backend(self.model, args.moe_backend)
        set_kernel_backend(self.model, "triton" if args.attention_backend == "triton" else "torch")
        layers, heads, kv_heads, head_dim = self.model.kv_spec()
        self.page_size = args.page_size or dllm.block_size
        context = model_config.context_length(args.context_length)
        max_pages_per_req = -(-(context + self.block_size) // self.page_size)
        bytes_per_token = 2 * layers * kv_heads * head_dim * self.dtype.itemsize
        num_pages = self._num_pages(args, context, bytes_per_token)
        self.kv = KVCache(layers, num_pages + 1, self.page_size, kv_heads, head_dim,
                          args.max_running_requests + 1, max_pages_per_req, self.dtype,
                          self.device)
        self.scratch_slot = args.max_running_requests  # its one page: the last one
        self.kv.set_pages([self.scratch_slot], [np.array([num_pages])])
        self.attn = ATTENTION_BACKENDS.get(args.attention_backend)(
            self.kv, heads, head_dim, self.model.attn_scale)
        logger.info("KV pool: %d pages of %d tokens (%.1f MB) on %s", num_pages, self.page_size,
                    num_pages * self.page_size * bytes_per_token / 1e6, self.device)
        self.graphs: DenoiseGraphs | None = None
        if self._want_graphs(args):
            self.graphs = self._capture_graphs(args.graph_max_blocks,
                                               model_config.vocab_size, dllm.mask_id)
        self.timer: ForwardTimer | None = None  # set to time every denoise forward

    @property
    def num_pages(self) -> int:
        """Pages the scheduler may hand out (the scratch page excluded)."""
        return self.kv.num_pages - 1

    def _want_graphs(self, args: ServerArgs) -> bool:
        if args.disable_cuda_graph or self.device.type != "cuda":
            return False
        if args.attention_backend != "triton" or args.moe_backend != "triton":
            logger.info("CUDA graphs need --attention-backend triton and --moe-backend triton; "
                        "denoise forwards run eagerly")
            return False
        return True

    def _capture_graphs(self, max_blocks: int, vocab: int, pad_id: int) -> DenoiseGraphs | None:
        """Capture the denoise graphs; on any failure warn and run eagerly instead."""
        graphs = None
        try:
            from dllm_serve.model.cuda_graph import DenoiseGraphs

            graphs = DenoiseGraphs(self.model, self.kv, self.attn, self.block_size, max_blocks,
                                   vocab, pad_id, self.scratch_slot)
            graphs.capture()
            return graphs
        except Exception as e:  # a graph must never take the server down
            logger.warning("CUDA graph capture failed, denoise forwards run eagerly "
                           "(--disable-cuda-graph silences this): %s: %s", type(e).__name__, e)
        del graphs
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # the device itself failed: the first eager forward will say so
            logger.exception("CUDA error after the failed capture")
        return None

    def _num_pages(self, args: ServerArgs, context: int, bytes_per_token: int) -> int:
        if args.max_total_tokens is not None:
            tokens = args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * args.mem_fraction_static - (total - free)
            tokens = int(budget // bytes_per_token)
            if tokens <= 0:
                raise MemoryError("no GPU memory left for the KV pool after loading the model; "
                                  "raise --mem-fraction-static")
        else:
            tokens = min(args.max_running_requests * (context + self.block_size),
                         CPU_MAX_KV_TOKENS)
        return max(1, tokens // self.page_size)

    # ---- batches ----------------------------------------------------------------------------

    def set_pages(self, req_slots: list[int], pages: list[np.ndarray]) -> None:
        self.kv.set_pages(req_slots, pages)

    def prefill_batch(self, work: PrefillWork) -> ForwardBatch:
        self.set_pages(work.req_slots, work.pages)
        ids = np.concatenate(work.token_ids)
        lens = [len(t) for t in work.token_ids]
        positions = np.concatenate([np.arange(s, s + n) for s, n in
                                    zip(work.seg_starts, lens, strict=True)])
        return self._batch(torch.from_numpy(ids).to(self.device), positions, work.req_slots,
                           work.seg_starts, lens, logits=False)

    def denoise_batch(self, req_slots: list[int], batch: DenoiseBatch) -> ForwardBatch:
        """One segment per request: its active blocks, contiguous from its first block.

        The batch's input_ids is a view of batch.block_ids (N, K), so the algorithm's in-place
        edits reach the next forward. Pages must already be set (set_pages).
        """
        k = self.block_size
        lens = [n * k for n in batch.num_blocks]
        positions = np.concatenate([np.arange(s, s + n) for s, n in
                                    zip(batch.first_starts, lens, strict=True)])
        return self._batch(batch.block_ids.view(-1), positions, req_slots, batch.first_starts,
                           lens, logits=True)

    def _batch(self, input_ids: torch.Tensor, positions: np.ndarray, req_slots: list[int],
               seg_starts: list[int], seg_lens: list[int], logits: bool) -> ForwardBatch:
        dev = self.device
        pos = torch.from_numpy(positions.astype(np.int64)).to(dev)
        slots = torch.as_tensor(req_slots, dtype=torch.int64, device=dev)
        seg_slot = torch.repeat_interleave(slots, torch.as_tensor(seg_lens, device=dev))
        fb = ForwardBatch(
            input_ids=input_ids, positions=pos, out_cache_loc=self.kv.slots(seg_slot, pos),
            req_slots=slots, seg_starts=torch.as_tensor(seg_starts, dtype=torch.int64, device=dev),
            seg_lens=torch.as_tensor(seg_lens, dtype=torch.int64, device=dev),
            block_size=self.block_size, attn=self.attn,
            logits_index=torch.arange(len(positions), device=dev) if logits else None,
            seg_starts_cpu=list(seg_starts), seg_lens_cpu=list(seg_lens))
        self.attn.prepare(fb)
        return fb

    def denoise_forward(self, req_slots: list[int], batch: DenoiseBatch
                        ) -> Callable[[], torch.Tensor]:
        """A repeatable forward over `batch` (pages set): each call reads batch.block_ids as
        they are then and returns logits (N * K, V) fp32, valid until the next call. Replays a
        CUDA graph when one holds the batch, else runs eagerly."""
        run = self.graphs.prepare(req_slots, batch) if self.graphs is not None else None
        if run is None:
            run = partial(self._logits, self.denoise_batch(req_slots, batch))
        return run if self.timer is None else self.timer.wrap(run)

    def _logits(self, fb: ForwardBatch) -> torch.Tensor:
        logits = self.forward(fb)
        assert logits is not None
        return logits

    # ---- forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Run the model; logits (N, V) fp32 for fb.logits_index rows, or None."""
        hidden = self.model(fb)  # (T, hidden)
        if fb.logits_index is None:
            return None
        return self.model.compute_logits(hidden[fb.logits_index])
