"""`dllm-serve`: parse the flags (generated from `ServerArgs`), check them, start the server.

A bad flag value ends the program with exit code 2 and one line on stderr, whether argparse
or a check rejects it. Importing this module stays cheap (no torch), so `--help` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import NoReturn

from dllm_serve.engine_config import EngineConfig
from dllm_serve.server_args import ServerArgs

PROG = "dllm-serve"
DESCRIPTION = (
    "Serve a block-diffusion language model (LLaDA2.x) over an OpenAI-compatible HTTP API. "
    "Without --model-path it serves a small built-in model. Requests are decoded greedily "
    "(temperature 0) unless they ask for a temperature.")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a single line (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    """Print `dllm-serve: error: <message>` as one line on stderr and exit 2."""
    sys.stderr.write(f"{PROG}: error: {' '.join(message.split())}\n")
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=DESCRIPTION)
    ServerArgs.add_cli_args(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Flags -> checked ServerArgs (model_path resolved); exits 2 with one line on any bad
    value."""
    return parse_config(argv).args


def parse_config(argv: list[str] | None = None) -> EngineConfig:
    """Flags -> the engine's configuration, resolved once (`preflight`); exits 2 with one line
    on any bad value."""
    ns = build_parser().parse_args(argv)
    try:
        return preflight(ServerArgs.from_cli_args(ns))
    except ValueError as e:
        fail(str(e))


def preflight(args: ServerArgs) -> EngineConfig:
    """Checks that need the package's heavier modules: the algorithm, its YAML, the model
    folder, then the configuration resolved from them (returned: resolved once).

    Raises ValueError with a user-facing message, so a typo fails before anything loads.
    """
    from dllm_serve.dllm.algorithm_settings import settings_of  # no torch for the built-ins
    from dllm_serve.dllm.config import ENGINE_KEYS, load_algorithm_yaml
    from dllm_serve.model.config import ModelConfig

    algorithm = settings_of(args.dllm_algorithm)
    settings = load_algorithm_yaml(args.dllm_algorithm_config)
    try:
        algorithm.parse_config({k: v for k, v in settings.items() if k not in ENGINE_KEYS})
    except TypeError as e:
        raise ValueError(f"--dllm-algorithm-config: {e}") from None
    if args.model_path is not None:
        try:
            ModelConfig.load(args.model_path)
        except FileNotFoundError as e:
            raise ValueError(f"--model-path: {e}") from None
        folder = Path(args.model_path)
        if args.load_format != "dummy" and not any(folder.glob("*.safetensors")):
            raise ValueError(f"--model-path: no *.safetensors weights in {str(folder)!r} "
                             f"(other formats, such as pytorch_model.bin, are not read)")
    if args.dllm_standby and not (args.dllm_wavefront_size == 1 and args.dllm_fdfo):
        logging.getLogger(__name__).warning(
            "--dllm-standby has no effect: it applies with --dllm-wavefront-size 1 and FDFO "
            "(got wavefront size %d, FDFO %s)", args.dllm_wavefront_size,
            "on" if args.dllm_fdfo else "off")
    try:  # config.json's values, the YAML's, the tokenizer's files: all read before any load
        return EngineConfig.resolve(args)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a broken file of any kind: one line, exit 2
        raise ValueError(" ".join(f"{type(e).__name__}: {e}".split())) from None


def flags_markdown() -> str:
    """README's flag table (flag, default, meaning), generated from ServerArgs."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        shown = _shown(f.default)
        if f.metadata.get("boolean"):
            flag += " / --no-" + f.name.replace("_", "-")
            shown = "auto" if f.default is None else shown  # resolved at startup
        rows.append(f"| `{flag}` | `{shown}` | {f.metadata['help']} |")
    return "\n".join(rows)


def _shown(default: object) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit code 130, without a traceback, on a Ctrl-C that comes before the server's
    own signal handlers are installed (while the checks run and the server's modules load)."""
    try:
        config = parse_config(argv)
        from dllm_serve.http.server import run_server

        return run_server(config)
    except KeyboardInterrupt:
        return 130
