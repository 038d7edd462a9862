"""Run bookkeeping: `Progress` (saved in the train state), the LR schedule, and `Clock`, which
prints progress lines and runs evals every so many seconds of wall time."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from training.config import TrainConfig
from training.objective import metrics

if TYPE_CHECKING:
    from training.trainer import StepOut, Trainer

logger = logging.getLogger(__name__)


@dataclass
class Progress:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    layout_tokens: int = 0  # tokens through the model (clean + noised copy, padding included)
    trained_tokens: int = 0  # completion positions of noised blocks (where the loss falls)
    train_seconds: float = 0.0
    horizon: int | None = None  # steps of the LR schedule
    last_train_loss: float | None = None


def lr_at(step: int, cfg: TrainConfig, horizon: int | None) -> float:
    """Linear warmup over warmup_steps, then cosine to lr * min_lr_ratio at `horizon`
    (constant after the warmup while the horizon is unknown)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if horizon is None:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Accumulates train time (evals excluded); logs and evaluates on wall-time intervals."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.last = self.last_log = self.last_eval = time.monotonic()
        self.tokens_at_log = trainer.progress.layout_tokens

    def tick(self, out: StepOut) -> None:
        now = time.monotonic()
        self.trainer.progress.train_seconds += now - self.last
        self.last = now
        run = self.trainer.run
        if now - self.last_log >= run.log_every_seconds:
            self.log(out)
        if now - self.last_eval >= run.eval_every_seconds:
            self.eval()

    def log(self, out: StepOut) -> None:
        t, p = self.trainer, self.trainer.progress
        m = metrics(*out)
        now = time.monotonic()
        rate = (p.layout_tokens - self.tokens_at_log) / max(now - self.last_log, 1e-9)
        p.last_train_loss = m["loss"]
        lr = t.optimizer.param_groups[0]["lr"]
        logger.info("step %6d  loss %.4f (m2t %.4f t2t %.4f)  acc masked %.3f fixed %.3f "
                    "kept %.3f  lr %.2e  %.0fk tok/s  experts max/mean %.2f  %.0f s", p.step,
                    m["loss"], m["m2t"], m["t2t"], m["acc_masked"], m["acc_fixed"],
                    m["acc_kept"], lr, rate / 1e3, t.last_imbalance, p.train_seconds)
        t.log({"kind": "train", "step": p.step, "lr": lr, "tokens_per_s": rate,
               "train_seconds": p.train_seconds, **m})
        self.last_log, self.tokens_at_log = time.monotonic(), p.layout_tokens
        self.last = self.last_log

    def eval(self) -> dict[str, float]:
        start = time.monotonic()
        t = self.trainer
        m = t.evaluate()
        logger.info("eval   step %6d  loss %.4f (m2t %.4f t2t %.4f)  acc masked %.3f fixed "
                    "%.3f kept %.3f", t.progress.step, m["loss"], m["m2t"], m["t2t"],
                    m["acc_masked"], m["acc_fixed"], m["acc_kept"])
        t.log({"kind": "eval", "step": t.progress.step, **m})
        self.last_eval = self.last = time.monotonic()
        self.last_log += self.last - start  # eval time is not train time
        return m

    def close(self) -> None:
        synchronize(self.trainer.device)
        self.trainer.progress.train_seconds += time.monotonic() - self.last
        self.last = time.monotonic()
