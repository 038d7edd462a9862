"""End to end on the tiny checkpoint: a ModelRunner with the Triton attention and MoE backends
and the fused step kernel (interpreted on the CPU) decodes the same greedy tokens as one with
the PyTorch reference paths. Pages are scattered; one request's prompt is prefilled in a
two-block chunk, the other's sits in its first generation block. On CUDA (bf16) the whole
model's logits are compared instead: greedy tokens of a random tiny model are too close to ties
for bf16 kernels to reproduce exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.dllm.batch import DenoiseBatch
from dllm_serve.engine_config import EngineConfig
from dllm_serve.model.runner import ModelRunner
from dllm_serve.server_args import ServerArgs

PROMPTS = [list(range(3, 3 + 75)), list(range(40, 49))]
PAGES = [np.array([9, 2, 7, 4, 11]), np.array([5, 0, 8, 1])]
BLOCKS = 3


def make_runner(model_dir: Path, backend: str, device: str = "cpu") -> tuple[ModelRunner, int]:
    args = ServerArgs(model_path=str(model_dir), device=device, attention_backend=backend,
                      moe_backend=backend, max_running_requests=2, max_total_tokens=512)
    cfg = EngineConfig.resolve(args).worker().runner
    runner = ModelRunner(cfg)
    for slot, pages in enumerate(PAGES):
        runner.add_pages(slot, 0, pages)
    return runner, cfg.mask_id


def forward(runner: ModelRunner, starts: list[int], ids: list[np.ndarray],
            logits: bool) -> torch.Tensor | None:
    if not logits:
        runner.prefill([0, 1][:len(ids)], starts, ids)
        return None
    k = runner.block_size
    block_ids = torch.from_numpy(np.concatenate(ids)).to(runner.device).view(-1, k)
    return runner.eager_forward([0, 1][:len(ids)], starts, [len(i) // k for i in ids],
                                block_ids)()


@torch.inference_mode()
def decode(model_dir: Path, backend: str) -> np.ndarray:
    """Prefill, then BLOCKS blocks per request with LowConfidence (threshold 0: each block
    takes one unmasking forward and one done-on-entry forward that overwrites its KV)."""
    runner, mask_id = make_runner(model_dir, backend)
    algo = LowConfidence(LowConfidenceConfig(threshold=0.0), runner.block_size, mask_id)
    algo.fused_predict = backend == "triton"
    k = runner.block_size
    forward(runner, [0], [np.array(PROMPTS[0][:2 * k])], logits=False)
    tokens = [list(PROMPTS[0]), list(PROMPTS[1])]
    for _ in range(BLOCKS):
        starts = [len(t) // k * k for t in tokens]
        rows = [t[s:] + [mask_id] * (s + k - len(t)) for t, s in zip(tokens, starts, strict=True)]
        batch = DenoiseBatch(torch.tensor(rows), [1, 1], starts, [0.0] * 2, [1.0] * 2, [0, 0],
                             {}, np.zeros(2, dtype=np.int64))
        while not algo.step(batch, forward(runner, starts, list(batch.block_ids.numpy()),
                                           logits=True), None).done.all():
            pass
        tokens = [t[:s] + row for t, s, row in zip(tokens, starts, batch.block_ids.tolist(),
                                                   strict=True)]
    return np.array([t[-BLOCKS * k:] for t in tokens])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; CUDA runs the gpu one")
def test_triton_kernels_decode_the_reference_tokens(tiny_model_dir: Path) -> None:
    ref = decode(tiny_model_dir, "torch")
    assert (ref != 0).any() and ref.shape == (2, BLOCKS * 32)
    np.testing.assert_array_equal(decode(tiny_model_dir, "triton"), ref)


@torch.inference_mode()
def first_logits(model_dir: Path, backend: str) -> torch.Tensor:
    """Logits of one denoise forward after a two-block prefill, bf16 on CUDA."""
    runner, mask_id = make_runner(model_dir, backend, device="cuda")
    k = runner.block_size
    forward(runner, [0], [np.array(PROMPTS[0][:2 * k])], logits=False)
    rows = [PROMPTS[0][2 * k:] + [mask_id] * (3 * k - 75), PROMPTS[1] + [mask_id] * (k - 9)]
    logits = forward(runner, [2 * k, 0], [np.array(r) for r in rows], logits=True)
    assert logits is not None
    return logits


@pytest.mark.gpu
def test_tiny_model_logits_with_compiled_kernels(tiny_model_dir: Path) -> None:
    ref = first_logits(tiny_model_dir, "torch")
    out = first_logits(tiny_model_dir, "triton")
    err = ((out - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err < 5e-2, f"relative error {err:.2e}"
