"""Write a tiny random checkpoint in a real model's exact HF layout.

    python scripts/make_tiny_model.py --arch llada2_moe --out /tmp/tiny-llada2 [--seed N]
        [--preset tiny] [--set num_hidden_layers=4 --set tie_word_embeddings=true]
    python scripts/make_tiny_model.py --arch sdar --out /tmp/tiny-sdar          # SDAR dense
    python scripts/make_tiny_model.py --arch sdar_moe --out /tmp/tiny-sdar-moe  # SDAR MoE
    python scripts/make_tiny_model.py --preset llada2-mini-shape --device cuda --out DIR
    python scripts/make_tiny_model.py --arch sdar --preset sdar-8b-shape --no-weights --out DIR

--arch: llada2_moe (LLaDA2.x), sdar (SDARForCausalLM), sdar_moe (SDARMoeForCausalLM). The SDAR
checkpoints carry a Qwen-style tokenizer with SDAR's special tokens at their real ids
(<|endoftext|> 151643, <|im_end|> 151645, <|MASK|> 151669) and the real vocab_size 151936.
Presets at real shapes: llada2-mini-shape (LLaDA2.0-mini, ~16B parameters: 32 GB of
safetensors, built in host memory before writing; --device cuda draws the random values on the
GPU), sdar-8b-shape (--arch sdar), sdar-30b-a3b-shape (--arch sdar_moe). For speed measurements
benchmarks/round_roofline.py builds the same models in GPU memory without writing them;
--no-weights writes only config.json and the tokenizer files, which the engine serves with
`--load-format dummy` (random weights built in memory).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from dllm_serve.tools.llada2_format import parse_config_override
from dllm_serve.tools.tiny_checkpoint import ARCHES, PRESETS, build_tiny_checkpoint


def parse_override(text: str) -> tuple[str, Any]:
    try:
        return parse_config_override(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="llada2_moe", choices=ARCHES)
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="same seed => identical files")
    parser.add_argument("--preset", default="tiny", choices=PRESETS)
    parser.add_argument("--device", default="cpu", help="where to draw the random weights")
    parser.add_argument("--no-weights", dest="weights", action="store_false",
                        help="config and tokenizer only (serve with --load-format dummy)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        type=parse_override, metavar="KEY=VALUE",
                        help="override a config.json value (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = build_tiny_checkpoint(args.out, arch=args.arch, seed=args.seed, preset=args.preset,
                                 device=args.device, weights=args.weights,
                                 **dict(args.overrides))
    print(path)


if __name__ == "__main__":
    main()
