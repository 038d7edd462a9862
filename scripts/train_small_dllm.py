"""Train the small block-diffusion model (LLaDA2 architecture) that ships as the default model.

    python scripts/train_small_dllm.py --out runs/small --max-minutes 8
    python scripts/train_small_dllm.py --out runs/small-b --resume runs/small/state --max-minutes 8

Writes OUT/model/ (a standard LLaDA2 HF checkpoint: config.json, model.safetensors, tokenizer
files, generation_config.json), OUT/train_log.jsonl, OUT/summary.json and the resumable train
state (OUT/state/ unless --state-dir). A run split into parts needs an explicit --max-steps (the
LR horizon; each part ends at --stop-at-step or its --max-minutes); without it the horizon is
fitted to this run's --max-minutes. Runs from a checkout
without installing the package; needs torch, numpy, safetensors and tokenizers.
"""

from __future__ import annotations

import time

START = time.monotonic()  # the --max-minutes budget counts from here, imports included

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dllm_serve.tools.llada2_format import parse_config_override  # noqa: E402
from training.config import PRESETS, RunConfig, TrainConfig  # noqa: E402
from training.data import DataConfig  # noqa: E402
from training.objective import NoiseConfig  # noqa: E402
from training.trainer import Trainer  # noqa: E402

DEFAULT_DATA = ROOT / "benchmarks" / "data" / "gsm8k" / "train.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (created)")
    p.add_argument("--resume", type=Path, default=None, help="a train-state folder to continue")
    p.add_argument("--state-dir", type=Path, default=None, help="where to save the train state")
    p.add_argument("--data-path", default=str(DEFAULT_DATA),
                   help="GSM8K train.jsonl ('none': generated problems only)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--max-minutes", type=float, default=8.0,
                   help="wall-clock budget from process start, saving included")
    p.add_argument("--max-steps", type=int, default=None, help="LR horizon and step limit")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="end this part of a split run at this step (resume it later)")
    p.add_argument("--reserve-seconds", type=float, default=20.0,
                   help="budget kept for the final eval and saving")
    p.add_argument("--log-every-seconds", type=float, default=20.0)
    p.add_argument("--eval-every-seconds", type=float, default=60.0)
    p.add_argument("--moe-backend", default="dense", help="dense or torch (moe_reference)")
    add_train_args(p)
    return p.parse_args(argv)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """Flags of TrainConfig (ignored with --resume: the saved run's config wins)."""
    d, n, c = DataConfig(), NoiseConfig(), TrainConfig()
    p.add_argument("--preset", default=c.preset, choices=sorted(PRESETS))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   type=parse_config_override, help="override a config.json value (repeatable)")
    p.add_argument("--vocab-size", type=int, default=c.vocab_size)
    p.add_argument("--dtype", default=c.dtype, help="dtype of the saved checkpoint")
    p.add_argument("--lr", type=float, default=c.lr)
    p.add_argument("--warmup-steps", type=int, default=c.warmup_steps)
    p.add_argument("--tokens-per-batch", type=int, default=c.tokens_per_batch)
    p.add_argument("--seed", type=int, default=c.seed)
    p.add_argument("--num-generated", type=int, default=d.num_generated)
    p.add_argument("--gsm8k-fraction", type=float, default=d.gsm8k_fraction)
    p.add_argument("--fewshot-fraction", type=float, default=d.fewshot_fraction)
    p.add_argument("--num-eval-generated", type=int, default=d.num_eval_generated)
    p.add_argument("--corrupt-max", type=float, default=n.corrupt_max)
    p.add_argument("--t2t-weight", type=float, default=n.t2t_weight)


def configs(ns: argparse.Namespace) -> tuple[TrainConfig, RunConfig]:
    data = DataConfig(num_generated=ns.num_generated, gsm8k_fraction=ns.gsm8k_fraction,
                      fewshot_fraction=ns.fewshot_fraction,
                      num_eval_generated=ns.num_eval_generated, seed=ns.seed)
    noise = NoiseConfig(corrupt_max=ns.corrupt_max, t2t_weight=ns.t2t_weight)
    cfg = TrainConfig(preset=ns.preset, overrides=dict(ns.overrides), vocab_size=ns.vocab_size,
                      dtype=ns.dtype, data=data, noise=noise, lr=ns.lr,
                      warmup_steps=ns.warmup_steps, tokens_per_batch=ns.tokens_per_batch,
                      seed=ns.seed)
    data_path = None if ns.data_path.lower() == "none" else Path(ns.data_path)
    if data_path is not None and not data_path.is_file():
        raise SystemExit(f"--data-path {ns.data_path}: no such file (pass 'none' to train on "
                         "generated problems only)")
    run = RunConfig(out=ns.out, state_dir=ns.state_dir, data_path=data_path, device=ns.device,
                    max_minutes=ns.max_minutes, max_steps=ns.max_steps,
                    stop_at_step=ns.stop_at_step,
                    reserve_seconds=ns.reserve_seconds, log_every_seconds=ns.log_every_seconds,
                    eval_every_seconds=ns.eval_every_seconds, moe_backend=ns.moe_backend,
                    start_time=START)
    return cfg, run


def print_summary(s: dict) -> None:
    ev = s["eval"]
    print("\n==== summary ====")
    print(f"steps {s['steps']} (horizon {s['horizon']}), epochs {s['epochs']:.2f}, "
          f"tokens seen {s['layout_tokens'] / 1e6:.1f}M layout / "
          f"{s['trained_tokens'] / 1e6:.1f}M trained")
    print(f"final train loss {s['final_train_loss']}, eval loss {ev['loss']:.4f} "
          f"(m2t {ev['m2t']:.4f}, t2t {ev['t2t']:.4f}, acc masked {ev['acc_masked']:.3f}, "
          f"fixed {ev['acc_fixed']:.3f}, kept {ev['acc_kept']:.3f})")
    print(f"train {s['train_seconds']} s at {s['layout_tokens_per_second'] / 1e3:.0f}k tok/s, "
          f"wall {s['wall_seconds']} s on {s['device']}")
    print(f"{s['parameters'] / 1e6:.2f}M parameters -> {s['checkpoint']} "
          f"({s['checkpoint_bytes'] / 1e6:.1f} MB)")


def main(argv: list[str] | None = None) -> None:
    ns = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg, run = configs(ns)
    summary = Trainer.setup(cfg, run, ns.resume).train()
    print_summary(summary)
    print(json.dumps({k: summary[k] for k in ("steps", "wall_seconds")}))


if __name__ == "__main__":
    main()
