"""The KV the engine caches for committed blocks equals a plain full-sequence forward of the same
tokens under the block-causal mask (fp32, CPU), for both algorithms and both modes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from batch_helpers import Segment, make_batch, make_cache

from dllm_serve.dllm.algorithms import RoundMode, build_algorithm
from dllm_serve.dllm.config import DllmConfig
from dllm_serve.dllm.wavefront import WavefrontConfig
from dllm_serve.managers.finish import FinishChecker
from dllm_serve.managers.messages import GenerateReq
from dllm_serve.managers.scheduler import Scheduler, SchedulerConfig
from dllm_serve.managers.worker import Worker
from dllm_serve.model.config import ModelConfig
from dllm_serve.model.runner import ModelRunner
from dllm_serve.sampling_params import SamplingParams
from dllm_serve.server_args import ServerArgs


def local_engine(model_dir: Path, algorithm: str, fdfo: bool, wavefront: int = 1,
                 page_size: int | None = None, **wavefront_kw: float | bool) -> Scheduler:
    """Scheduler + worker in this process (no ZMQ), on the CPU in fp32."""
    args = ServerArgs(model_path=str(model_dir), device="cpu", dllm_algorithm=algorithm,
                      dllm_fdfo=fdfo, max_running_requests=2, chunked_prefill_size=32,
                      page_size=page_size)
    mc = ModelConfig.load(model_dir)
    dllm = DllmConfig.build(mc, algorithm, None, fdfo)
    runner = ModelRunner(mc, dllm, args)
    cfg = SchedulerConfig(dllm.block_size, dllm.mask_id, fdfo, 2, None, 32, runner.num_pages,
                          runner.page_size)
    mode = RoundMode(fdfo, WavefrontConfig(wavefront, **wavefront_kw))  # type: ignore[arg-type]
    worker = Worker(runner, build_algorithm(dllm), mode)
    cfg = dataclasses.replace(cfg, wavefront_size=wavefront)
    return Scheduler(cfg, worker, FinishChecker(set(), None))


def reference_kv(runner: ModelRunner, tokens: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """K/V of every layer from one forward of all tokens as a single block-causal segment."""
    model = runner.model
    kv, attn = make_cache(model.kv_spec(), 1, len(tokens), runner.page_size)
    fb = make_batch([Segment(0, 0, tokens)], kv, attn, runner.block_size)
    with torch.inference_mode():
        model(fb)
    slots = kv.slots(torch.zeros(len(tokens), dtype=torch.int64), torch.arange(len(tokens)))
    return [(kv.k[i][slots], kv.v[i][slots]) for i in range(len(kv.k))]


@pytest.mark.parametrize("algorithm", ["LowConfidence", "JointThreshold"])
@pytest.mark.parametrize("fdfo", [True, False])
def test_committed_kv_equals_full_recomputation(tiny_model_dir: Path, algorithm: str,
                                                fdfo: bool) -> None:
    sched = local_engine(tiny_model_dir, algorithm, fdfo)
    runner: ModelRunner = sched.worker.runner  # type: ignore[attr-defined]
    prompts = {"a": list(range(3, 3 + 75)), "b": list(range(40, 40 + 9))}
    for rid, ids in prompts.items():
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        sched.add_request(GenerateReq(rid, np.asarray(ids), params, 0.0))
    while min((r.blocks for r in sched.running), default=0) < 3:
        sched.step()
    for req in sched.running:
        n = req.committed_len
        tokens = (list(req.input_ids) + req.output_ids)[:n]
        slots = runner.kv.slots(torch.full((n,), req.holding.slot), torch.arange(n))
        for layer, (k_ref, v_ref) in enumerate(reference_kv(runner, tokens)):
            torch.testing.assert_close(runner.kv.k[layer][slots], k_ref, atol=2e-5, rtol=1e-4,
                                       msg=f"K of layer {layer}, request {req.rid}")
            torch.testing.assert_close(runner.kv.v[layer][slots], v_ref, atol=2e-5, rtol=1e-4,
                                       msg=f"V of layer {layer}, request {req.rid}")
