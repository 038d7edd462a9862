"""The front (HTTP server, TokenizerManager, the offline Engine's process) never imports torch
or Triton: the scheduler and the worker do. The children are spawned by entry-point name
(managers/procs.spawn), the worker resolves its device-dependent config itself
(worker_main.run_worker_process) and a request's dllm_* overrides are checked against the
algorithms' torch-free settings (dllm/algorithm_settings.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dllm_serve.dllm.algorithm_settings import BUILTIN, settings_of
from dllm_serve.dllm.algorithms import ALGORITHMS

SCRIPT = """
import json, sys
from dllm_serve import Engine

if __name__ == "__main__":
    with Engine(model_path=sys.argv[1], device="auto") as engine:
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params={
            "max_new_tokens": 4, "ignore_eos": True, "dllm_threshold": 0.5})
        try:
            engine.generate(input_ids=[[5, 6, 7]], sampling_params={"dllm_threshold": 2.0})
            refused = ""
        except Exception as e:
            refused = str(e)
        print(json.dumps({"tokens": out[0]["meta_info"]["completion_tokens"],
                          "refused": refused, "torch": "torch" in sys.modules,
                          "triton": "triton" in sys.modules}))
"""


def test_a_serving_front_has_no_torch(tiny_model_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, str(script), str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["tokens"] == 4
    assert "dllm_threshold" in found["refused"] and "[0, 1]" in found["refused"]
    assert not found["torch"] and not found["triton"], found


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_settings_are_the_registered_algorithms(name: str) -> None:
    """The front's table and the step classes agree (one source: the classes take theirs
    from it)."""
    cls = ALGORITHMS.get(name)
    assert cls.Config is BUILTIN[name].config
    assert cls.request_params == BUILTIN[name].request_params
    assert settings_of(name) is BUILTIN[name]


def test_a_plugin_algorithm_is_checked_through_its_class() -> None:
    """A plugin's settings come from its class (its module imported), with LowConfidence's
    checks when it inherits them; unknown names fail loudly."""
    settings = settings_of("faulty_algorithms:Raising")
    assert settings.name == "Raising" and settings.request_params == ("threshold",)
    assert settings.validate_request_params({"threshold": 0.25}) == {"threshold": 0.25}
    with pytest.raises(ValueError, match="dllm_threshold: LowConfidence threshold"):
        settings.validate_request_params({"threshold": 1.5})
    with pytest.raises(ValueError, match="dllm_edit_threshold is not a setting of Raising"):
        settings.validate_request_params({"edit_threshold": 0.5})
    with pytest.raises(ValueError, match="NoSuchAlgorithm"):
        settings_of("NoSuchAlgorithm")
