"""The `dllm-serve` command line: --help, and one-line exit-2 errors for bad flag values."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_serve.cli import flags_markdown, main
from dllm_serve.server_args import ServerArgs

REPO = Path(__file__).resolve().parents[1]


def test_help_lists_every_flag() -> None:
    out = subprocess.run([sys.executable, "-m", "dllm_serve", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in out.stdout, f.name
    assert "--no-dllm-fdfo" in out.stdout and "(default: 30000)" in out.stdout


@pytest.mark.parametrize("argv,words", [
    (["--port", "abc"], "invalid int value"),
    (["--port", "0"], "--port"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--device", "tpu"], "invalid choice"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--dllm-gate-arm-forwards", "-1"], "--dllm-gate-arm-forwards"),
    (["--dllm-gate-arm-forwards", "nan"], "--dllm-gate-arm-forwards"),
    (["--gc-warning-threshold-secs", "-1"], "--gc-warning-threshold-secs"),
    (["--dllm-algorithm", "Nope"], "LowConfidence"),
    (["--dllm-algorithm-config", "/no/such.yaml"], "no such file"),
    (["--model-path", "/no/such/model"], "--model-path"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--attention-backend", "flash"], "invalid choice"),
    (["--moe-backend", "cutlass"], "invalid choice"),
    (["--random-seed", str(2**64)], "--random-seed"),
    (["--page-size", "33"], "multiple of the model's block size"),
    (["--context-length", "8192"], "longer than the model's max_position_embeddings (4096"),
])
def test_bad_flag_value_is_one_line_and_exit_2(argv: list[str], words: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dllm-serve: error: ") and words in err


def test_a_longer_context_is_served_only_when_the_environment_allows_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's and vLLM's rule: a --context-length past the model's positions is refused
    unless an environment variable allows it (then it is served as asked)."""
    from dllm_serve.cli import parse_config
    from dllm_serve.model.config import ALLOW_LONGER_CONTEXT_ENV

    assert parse_config(["--context-length", "4096"]).context_length == 4096
    monkeypatch.setenv(ALLOW_LONGER_CONTEXT_ENV, "1")
    assert parse_config(["--context-length", "8192"]).context_length == 8192


def test_ctrl_c_before_the_server_runs_exits_130_without_a_traceback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a Ctrl-C while the checks ran or the server's modules loaded (the first
    second) printed a KeyboardInterrupt traceback."""
    import dllm_serve.cli as cli

    def interrupted(argv: list[str] | None = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "parse_config", interrupted)
    assert cli.main([]) == 130
    assert "Traceback" not in capsys.readouterr().err


def test_bad_algorithm_setting_in_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       ) -> None:
    config = tmp_path / "algo.yaml"
    config.write_text("threshold: 0.9\nno_such_knob: 1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["--dllm-algorithm-config", str(config)])
    assert exit_info.value.code == 2 and "no_such_knob" in capsys.readouterr().err


def test_module_entry_reports_bad_values_on_stderr() -> None:
    out = subprocess.run([sys.executable, "-m", "dllm_serve", "--port", "99999"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "dllm-serve: error: --port must be in 1..65535, got 99999\n"


def test_readme_flag_table_matches_server_args() -> None:
    assert flags_markdown() in (REPO / "README.md").read_text(), (
        "README's flag table is out of date; regenerate it with "
        "python -c 'from dllm_serve.cli import flags_markdown; print(flags_markdown())'")


def test_backend_choices_are_the_registries() -> None:
    """The flags' choices (kept torch-free for the front) name exactly the registered backends."""
    from dllm_serve.kernels import fused_moe, triton_attention  # noqa: F401 (registers triton)
    from dllm_serve.layers.attention import ATTENTION_BACKENDS
    from dllm_serve.layers.moe import MOE_BACKENDS
    from dllm_serve.server_args import ATTENTION_BACKEND_NAMES, MOE_BACKEND_NAMES

    assert set(ATTENTION_BACKEND_NAMES) == {"auto", *ATTENTION_BACKENDS.names()}
    assert set(MOE_BACKEND_NAMES) == {"auto", *MOE_BACKENDS.names()}


@pytest.mark.parametrize("broken,words", [
    ({"config.json": "{not json"}, "config.json: not valid JSON"),
    ({"config.json": "[1, 2]"}, "config.json: expected a JSON object"),
    ({"generation_config.json": "{bad"}, "generation_config.json: not valid JSON"),
    ({"tokenizer_config.json": "{bad"}, "tokenizer_config.json: not valid JSON"),
    ({"vocab_size": "abc"}, "vocab_size must be an integer"),
    ({"mask_token_id": 10**9}, "mask id 1000000000 is outside the vocabulary"),
    ({"tokenizer.json": None}, "tokenizer"),
    ({"model.safetensors": None}, "no *.safetensors weights"),
    ({"yaml": "threshold: [0.5"}, "not valid YAML"),
])
def test_a_broken_checkpoint_or_yaml_is_one_line_and_exit_2(
        tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        broken: dict, words: str) -> None:
    """What the worker would only find out loading (or the first request, for a mask id past
    the vocabulary) is refused by the CLI's checks first: one line naming it, exit 2."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    argv = ["--model-path", str(model)]
    for key, value in broken.items():
        if key == "yaml":
            (tmp_path / "algo.yaml").write_text(value)
            argv += ["--dllm-algorithm-config", str(tmp_path / "algo.yaml")]
        elif value is None:
            (model / key).unlink()
        elif key.endswith(".json"):
            (model / key).write_text(value)
        else:
            cfg = json.loads((model / "config.json").read_text())
            (model / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("argv,warned", [
    (["--dllm-standby"], True),  # the default wavefront size is 2
    (["--dllm-standby", "--dllm-wavefront-size", "1", "--no-dllm-fdfo"], True),
    (["--dllm-standby", "--dllm-wavefront-size", "1"], False)])
def test_standby_without_its_mode_is_warned(argv: list[str], warned: bool,
                                            caplog: pytest.LogCaptureFixture) -> None:
    from dllm_serve.cli import parse_args

    with caplog.at_level("WARNING"):
        parse_args(argv)
    assert ("--dllm-standby has no effect" in caplog.text) == warned
