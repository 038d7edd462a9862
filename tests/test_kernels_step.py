"""The fused step kernel gives `DllmAlgorithm.predict`'s (x, p) for greedy rows, and the
algorithms' steps fed by it edit the blocks exactly as with the PyTorch path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dllm_serve.dllm.algorithms.joint_threshold import JointThreshold, JointThresholdConfig
from dllm_serve.dllm.algorithms.low_confidence import LowConfidence, LowConfidenceConfig
from dllm_serve.kernels.step import argmax_confidence, choose_splits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def greedy_batch(block_ids: torch.Tensor) -> SimpleNamespace:
    """What predict/step read of a DenoiseBatch: greedy rows, no per-request overrides."""
    return SimpleNamespace(block_ids=block_ids, params={}, sampled=False,
                           size=block_ids.shape[0])


def reference(logits: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    algo = LowConfidence(LowConfidenceConfig(), block_size=logits.shape[1], mask_id=mask_id)
    algo.fused_predict = False
    return algo.predict(greedy_batch(logits.new_zeros(logits.shape[:2])), logits.clone())


def planted_logits(rows: int, block: int, vocab: int, mask_id: int, dtype: torch.dtype,
                   seed: int) -> torch.Tensor:
    """Random logits (rows, block, V); some rows peak at the mask token (excluded), some have
    the same maximum at two far-apart ids (the first wins), some are sharply peaked."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, block, vocab, generator=gen)
    logits[0, :, mask_id] = 50.0
    logits[-1, 0, [vocab // 3, vocab - 2]] = 40.0
    logits[-1, 1, 7] = 30.0
    return logits.to(DEVICE, dtype)


@pytest.mark.parametrize("rows,vocab,dtype", [(1, 389, torch.float32), (3, 5000, torch.float32),
                                              (2, 4099, torch.bfloat16),
                                              (1, 9000, torch.float32)])  # rows split in two
def test_argmax_confidence_equals_predict(rows: int, vocab: int, dtype: torch.dtype) -> None:
    logits = planted_logits(rows, 4, vocab, mask_id=vocab - 5, dtype=dtype, seed=rows)
    x, p = argmax_confidence(logits, mask_id=vocab - 5)
    ref_x, ref_p = reference(logits, vocab - 5)
    assert torch.equal(x, ref_x) and x.dtype == torch.int64
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-7)


def test_choose_splits() -> None:
    assert choose_splits(rows=32, vocab=157184, sms=132) == 32
    assert choose_splits(rows=2048, vocab=157184, sms=132) == 1
    assert choose_splits(rows=1, vocab=1000, sms=132) == 1


def run_steps(algo: LowConfidence | JointThreshold, fused: bool, ids: torch.Tensor,
              logits: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    algo.fused_predict = fused
    batch = greedy_batch(ids.clone())
    state = algo.init_step_state(batch.block_ids)
    done = [algo.step(batch, step_logits.view(-1, step_logits.shape[-1]), state).done
            for step_logits in logits]
    return batch.block_ids, done


@pytest.mark.parametrize("algo", [LowConfidence(LowConfidenceConfig(0.3), 8, 60),
                                  JointThreshold(JointThresholdConfig(0.3, 0.2), 8, 60)],
                         ids=["LowConfidence", "JointThreshold"])
def test_steps_fed_by_the_kernel_match_the_torch_path(algo: LowConfidence | JointThreshold
                                                      ) -> None:
    ids = torch.full((3, 8), 60, device=DEVICE)
    ids[1, :3] = torch.tensor([5, 6, 7])
    logits = [planted_logits(3, 8, 64, 60, torch.float32, seed) for seed in range(4)]
    ref_ids, ref_done = run_steps(algo, False, ids, logits)
    out_ids, done = run_steps(algo, True, ids, logits)
    assert torch.equal(out_ids, ref_ids)
    assert all(torch.equal(a, b) for a, b in zip(done, ref_done, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_llada2_vocab(batch: int) -> None:
    mask_id = 156895
    logits = planted_logits(batch, 32, 157184, mask_id, torch.bfloat16, seed=batch)
    x, p = argmax_confidence(logits, mask_id)
    ref_x, ref_p = reference(logits, mask_id)
    assert torch.equal(x, ref_x)
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-7)
