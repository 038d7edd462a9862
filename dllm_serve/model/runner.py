"""`ModelRunner`: the model, its KV memory and the attention backend on one device.

It turns scheduler work (PrefillWork / DenoiseWork) into `ForwardBatch`es and runs forwards.
A denoise batch's `input_ids` is a view of the round's block ids (B, K), so an algorithm that
edits the block ids in place changes what the next forward of the same batch sees.
"""

from __future__ import annotations

import importlib.util
import logging

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
from dllm_serve.model.loader import load_model
from dllm_serve.server_args import ServerArgs

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
        self.model = model if model is not None else load_model(model_config, self.dtype,
                                                                self.device)
        set_moe_backend(self.model, args.moe_backend)
        set_kernel_backend(self.model, "triton" if args.attention_backend == "triton" else "torch")
        layers, heads, kv_heads, head_dim = self.model.kv_spec()
        self.page_size = args.page_size or dllm.block_size
        context = model_config.context_length(args.context_length)
        max_pages_per_req = -(-(context + self.block_size) // self.page_size)
        bytes_per_token = 2 * layers * kv_heads * head_dim * self.dtype.itemsize
        num_pages = self._num_pages(args, context, bytes_per_token)
        self.kv = KVCache(layers, num_pages, self.page_size, kv_heads, head_dim,
                          args.max_running_requests, max_pages_per_req, self.dtype, self.device)
        self.attn = ATTENTION_BACKENDS.get(args.attention_backend)(
            self.kv, heads, head_dim, self.model.attn_scale)
        logger.info("KV pool: %d pages of %d tokens (%.1f MB) on %s", num_pages, self.page_size,
                    num_pages * self.page_size * bytes_per_token / 1e6, self.device)

    @property
    def num_pages(self) -> int:
        return self.kv.num_pages

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

    # ---- forward ----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Run the model; logits (N, V) fp32 for fb.logits_index rows, or None."""
        hidden = self.model(fb)  # (T, hidden)
        if fb.logits_index is None:
            return None
        return self.model.compute_logits(hidden[fb.logits_index])
