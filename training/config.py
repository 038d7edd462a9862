"""Training settings: what defines the trained model (TrainConfig, saved with the train state and
restored on resume) and how this particular run goes (RunConfig: budget, output, logging).

Model shapes are presets of LLaDA2 config.json keys (plus `--set KEY=VALUE` overrides), so the
trained checkpoint has exactly LLaDA2's config keys. "small" is the shipped default model:
about 7.2M parameters (14 MB in bf16), 6 layers (layer 0 dense, 5 MoE layers of 8 experts,
top-2 in 4 groups, 1 shared expert), hidden 256, 4 heads / 2 KV heads of 64, vocab 4096.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.data import DataConfig
from training.objective import NoiseConfig

PRESETS: dict[str, dict[str, Any]] = {
    "small": {
        "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "partial_rotary_factor": 0.5, "rotary_dim": 32,
        "intermediate_size": 768, "moe_intermediate_size": 96, "num_experts": 8,
        "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 4, "topk_group": 2, "rope_theta": 10000, "max_position_embeddings": 4096,
        "max_window_layers": 6, "sliding_window": 4096,
    },
    "toy": {  # for tests: trains in seconds on a CPU
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "partial_rotary_factor": 0.5, "rotary_dim": 8,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 2, "topk_group": 1, "rope_theta": 10000, "max_position_embeddings": 4096,
        "max_window_layers": 2, "sliding_window": 4096,
    },
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (given the GSM8K rows and a device)."""

    preset: str = "small"
    overrides: dict[str, Any] = field(default_factory=dict)  # LLaDA2 config.json keys
    vocab_size: int = 4096  # tokenizer size, special tokens included
    block_size: int = 32  # LLaDA2's
    dtype: str = "bfloat16"  # of the saved checkpoint (training keeps fp32 master weights)
    data: DataConfig = field(default_factory=DataConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    tokens_per_batch: int = 65536  # layout tokens (clean + noised copy, padding included)
    balance_rate: float = 1e-3  # expert_bias step per optimizer step
    seed: int = 0

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.tokens_per_batch < 2 * self.block_size:
            raise ValueError(f"tokens_per_batch {self.tokens_per_batch} is below one sequence")

    def model_keys(self) -> dict[str, Any]:
        """config.json values this config sets (preset <- overrides <- dtype)."""
        return {**PRESETS[self.preset], **self.overrides, "dtype": self.dtype}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        d["data"], d["noise"] = DataConfig(**d["data"]), NoiseConfig(**d["noise"])
        d["betas"] = tuple(d["betas"])
        return TrainConfig(**d)


@dataclass(frozen=True)
class RunConfig:
    """This invocation: where to write, how long, how often to report."""

    out: Path  # out/model (HF checkpoint), out/train_log.jsonl, out/summary.json
    state_dir: Path | None = None  # train state (default out/state)
    data_path: Path | None = None  # GSM8K train.jsonl; None: generated problems only
    device: str = "auto"
    max_minutes: float = 8.0  # wall clock from process start, saving included
    max_steps: int | None = None  # schedule horizon; None: fitted to the time budget
    stop_at_step: int | None = None  # end this part of a split run here (horizon unchanged)
    reserve_seconds: float = 20.0  # kept for the final eval and saving
    log_every_seconds: float = 20.0
    eval_every_seconds: float = 60.0
    moe_backend: str = "dense"  # "dense" (no host sync) or "torch" (moe_reference)
    start_time: float | None = None  # time.monotonic() at process start

    @property
    def model_dir(self) -> Path:
        return self.out / "model"

    @property
    def resolved_state_dir(self) -> Path:
        return self.state_dir if self.state_dir is not None else self.out / "state"
