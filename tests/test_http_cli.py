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
])
def test_bad_flag_value_is_one_line_and_exit_2(argv: list[str], words: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dllm-serve: error: ") and words in err


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
