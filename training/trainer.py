"""The training loop of the small block-diffusion model, with a wall-clock budget and resume.

    trainer = Trainer.setup(cfg, run, resume=None)   # data, tokenizer, model, optimizer
    summary = trainer.train()                         # loop, final eval, save, summary

One step: a length-bucketed batch (batches.py) -> layout + noise + mask (objective.py) ->
forward under bf16 autocast on CUDA (fp32 master weights, AdamW) -> loss -> backward -> clipped
step -> expert-bias balancing (balance.py). The learning rate warms up linearly, then follows a
cosine to min_lr_ratio over the horizon: --max-steps if given, else fitted once to the time
budget from the step time measured between CALIBRATION steps (inside the warmup, so before the
horizon matters). The run stops at the horizon or when the budget, minus a reserve for the
final eval and saving, is spent.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dllm_serve.layers.moe import set_moe_backend
from dllm_serve.models.llada2 import LLaDA2MoeModelLM
from training import checkpoint as ckpt
from training.attention import TrainingAttention
from training.balance import ExpertBalancer
from training.batches import collate, plan_epoch
from training.config import RunConfig, TrainConfig
from training.objective import Layout, LossParts, Noised, forward_loss, metrics
from training.progress import Clock, Progress, lr_at, synchronize
from training.setup import Prepared, prepare

logger = logging.getLogger(__name__)

StepOut = tuple[LossParts, Layout, Noised]
CALIBRATION = (20, 60)  # steps between which the step time is measured to fit the horizon
SAFETY = 0.97  # fraction of the remaining budget the fitted horizon plans to use


class Trainer:
    def __init__(self, cfg: TrainConfig, run: RunConfig, prep: Prepared,
                 state: dict[str, Any] | None = None) -> None:
        self.cfg, self.run, self.prep, self.device = cfg, run, prep, prep.device
        self.model = build_model(prep.hf_config, self.device, cfg.seed)
        set_moe_backend(self.model, run.moe_backend)
        c = self.model.config
        self.attn = TrainingAttention(c.num_heads, c.head_dim, self.model.attn_scale)
        self.optimizer = make_optimizer(self.model, cfg, self.device)
        self.balancer = ExpertBalancer(self.model, cfg.balance_rate)
        self.progress = Progress(horizon=run.max_steps)
        if state is not None:
            self._restore(state)
        self.plan = self._plan(self.progress.epoch)
        self._calib_start = 0.0

    @staticmethod
    def setup(cfg: TrainConfig, run: RunConfig, resume: Path | None = None) -> Trainer:
        """A fresh run from `cfg`, or the run saved in `resume` (whose config then wins)."""
        if resume is None:
            return Trainer(cfg, run, prepare(cfg, run, None))
        state, tok = ckpt.load_train_state(resume)
        cfg = TrainConfig.from_dict(state["config"])
        logger.info("resuming %s at step %d", resume, state["progress"]["step"])
        return Trainer(cfg, run, prepare(cfg, run, tok), state)

    def _restore(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.prep.fingerprint:
            raise ValueError(f"--resume: the data pool differs from the saved run's (pass the "
                             f"same --data-path); saved {state['fingerprint']}, now "
                             f"{self.prep.fingerprint}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.progress = Progress(**state["progress"])
        if self.run.max_steps is not None:
            self.progress.horizon = self.run.max_steps
        ckpt.set_rng_states(state["rng"], self.device)

    def _plan(self, epoch: int) -> list[np.ndarray]:
        cfg = self.cfg
        return plan_epoch(self.prep.pool, cfg.block_size, cfg.tokens_per_batch, cfg.seed, epoch)

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        """Train until the horizon or the deadline, then evaluate, save and summarise."""
        self.run.out.mkdir(parents=True, exist_ok=True)
        start = self.run.start_time if self.run.start_time is not None else time.monotonic()
        deadline = start + self.run.max_minutes * 60 - self.run.reserve_seconds
        self._announce()
        clock = Clock(self)
        out: StepOut | None = None
        while not self._finished(deadline):
            out = self.step()
            self._calibrate(deadline)
            clock.tick(out)
        if out is not None:
            clock.log(out)
        clock.close()
        return self._finish(clock.eval())

    def _announce(self) -> None:
        n = sum(p.numel() for p in self.model.parameters())
        logger.info("model %s: %.2fM parameters, %d layers; %d batches per epoch; device %s",
                    self.cfg.preset, n / 1e6, self.model.config.num_layers, len(self.plan),
                    device_name(self.device))

    def _finished(self, deadline: float) -> bool:
        p, stop = self.progress, self.run.stop_at_step
        return ((p.horizon is not None and p.step >= p.horizon)
                or (stop is not None and p.step >= stop) or time.monotonic() >= deadline)

    def step(self) -> StepOut:
        """One optimizer step on the next batch."""
        p, cfg, prep = self.progress, self.cfg, self.prep
        host = collate(prep.pool, self._next_batch(), cfg.block_size, prep.eos_id)
        batch = host.to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(p.step, cfg, p.horizon)
        self.balancer.counting = True
        with autocast(self.device):
            out = forward_loss(self.model, self.attn, batch, cfg.noise, prep.mask_id,
                               prep.num_text_tokens)
        self.balancer.counting = False
        out[0].loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.update()
        p.step += 1
        p.layout_tokens += host.layout_tokens
        p.trained_tokens += host.completion_tokens
        return out

    def _next_batch(self) -> np.ndarray:
        p = self.progress
        if p.batch_in_epoch >= len(self.plan):
            p.epoch, p.batch_in_epoch = p.epoch + 1, 0
            self.plan = self._plan(p.epoch)
        p.batch_in_epoch += 1
        return self.plan[p.batch_in_epoch - 1]

    def _calibrate(self, deadline: float) -> None:
        """Fit the LR horizon to the budget from the step time between CALIBRATION steps."""
        p = self.progress
        if p.horizon is not None or p.step not in CALIBRATION:
            return
        synchronize(self.device)
        if p.step == CALIBRATION[0]:
            self._calib_start = time.monotonic()
            return
        per_step = (time.monotonic() - self._calib_start) / (CALIBRATION[1] - CALIBRATION[0])
        p.horizon = p.step + int(SAFETY * (deadline - time.monotonic()) / per_step)
        logger.info("%.1f ms per step: LR horizon set to %d steps", per_step * 1e3, p.horizon)

    @property
    def last_imbalance(self) -> float:
        return self.balancer.imbalance()

    # ---- evaluation, saving -----------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean metrics over the held-out pool, under the same noise every time."""
        cfg, pool = self.cfg, self.prep.eval_pool
        plan = plan_epoch(pool, cfg.block_size, cfg.tokens_per_batch, cfg.seed, 0)
        totals: dict[str, float] = {}
        for k, idx in enumerate(plan):
            gen = torch.Generator(self.device).manual_seed(cfg.seed + k)
            batch = collate(pool, idx, cfg.block_size, self.prep.eos_id).to(self.device)
            with autocast(self.device):
                out = forward_loss(self.model, self.attn, batch, cfg.noise, self.prep.mask_id,
                                   self.prep.num_text_tokens, gen)
            for key, value in metrics(*out).items():
                totals[key] = totals.get(key, 0.0) + value / len(plan)
        return totals

    def state(self) -> dict[str, Any]:
        """The resumable train state (tensors and plain values only)."""
        return {"config": self.cfg.to_dict(), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "progress": asdict(self.progress),
                "rng": ckpt.rng_states(self.device), "step": self.progress.step,
                "fingerprint": self.prep.fingerprint}

    def _finish(self, final: dict[str, float]) -> dict[str, Any]:
        path = ckpt.save_hf_checkpoint(self.run.model_dir, self.model, self.prep.tok,
                                       self.prep.hf_config)
        ckpt.save_train_state(self.run.resolved_state_dir, self.state(), self.prep.tok)
        summary = self._summary(final, path)
        (self.run.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def _summary(self, final: dict[str, float], path: Path) -> dict[str, Any]:
        p, start = self.progress, self.run.start_time
        return {
            "steps": p.step, "horizon": p.horizon,
            "epochs": round(p.epoch + p.batch_in_epoch / max(1, len(self.plan)), 3),
            "layout_tokens": p.layout_tokens, "trained_tokens": p.trained_tokens,
            "train_seconds": round(p.train_seconds, 1),
            "layout_tokens_per_second": round(p.layout_tokens / max(p.train_seconds, 1e-9)),
            "wall_seconds": None if start is None else round(time.monotonic() - start, 1),
            "final_train_loss": p.last_train_loss, "eval": final,
            "parameters": sum(t.numel() for t in self.model.parameters()),
            "checkpoint": str(path),
            "checkpoint_bytes": (path / "model.safetensors").stat().st_size,
            "device": device_name(self.device), "config": self.cfg.to_dict(),
        }

    def log(self, record: dict[str, Any]) -> None:
        with open(self.run.out / "train_log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def build_model(hf_config: dict[str, Any], device: torch.device, seed: int) -> nn.Module:
    """A freshly initialised fp32 LLaDA2MoeModelLM on `device` (same seed, same weights)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LLaDA2MoeModelLM(hf_config)
    return model.train()


def make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device
                   ) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms); the frozen expert_bias left out."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")


def autocast(device: torch.device) -> AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
