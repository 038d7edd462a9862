"""The algorithms' settings apart from their step code: no torch.

Each algorithm's frozen settings dataclass (its `Config`, loaded from the YAML, whose
`__post_init__` holds the range checks) and the settings a request may override with
`dllm_<name>`. The HTTP front checks a request's overrides here before it sends the request on,
so for a built-in algorithm it never imports the step code and torch with it (that is the
scheduler's and the worker's); a plugin algorithm (`module:Class`) is imported to be checked.
The step classes (algorithms/low_confidence.py, algorithms/joint_threshold.py) take their
Config and request_params from here; tests/test_front_without_torch.py checks that `BUILTIN`
and the registry agree. (Outside the algorithms package: importing that package imports the step
code.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dllm_serve.sampling_params import is_finite_number


@dataclass(frozen=True)
class AlgorithmConfig:
    """Base of each algorithm's frozen settings dataclass (loaded from the YAML)."""


@dataclass(frozen=True)
class LowConfidenceConfig(AlgorithmConfig):
    threshold: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"LowConfidence threshold must be in [0, 1], got {self.threshold}")


@dataclass(frozen=True)
class JointThresholdConfig(AlgorithmConfig):
    threshold: float = 0.5
    edit_threshold: float = 0.0
    max_post_edit_steps: int = 16
    penalty_lambda: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"JointThreshold threshold must be in [0, 1], got {self.threshold}")
        if self.edit_threshold < 0.0:
            raise ValueError(f"edit_threshold must be >= 0, got {self.edit_threshold}")
        if self.max_post_edit_steps < 0:
            raise ValueError(f"max_post_edit_steps must be >= 0, got {self.max_post_edit_steps}")
        if self.penalty_lambda < 0.0:
            raise ValueError(f"penalty_lambda must be >= 0, got {self.penalty_lambda}")


@dataclass(frozen=True)
class Settings:
    """One algorithm's settings: its Config and the names (without `dllm_`) a request may
    override."""

    name: str
    config: type[AlgorithmConfig]
    request_params: tuple[str, ...]

    def parse_config(self, settings: dict[str, Any]) -> AlgorithmConfig:
        """The YAML's settings -> the Config (its range checks run); ValueError naming an
        unknown setting."""
        known = {f.name for f in fields(self.config)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"{self.name} has no setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known)) or '(none)'}")
        return self.config(**settings)

    def validate_request_params(self, values: dict[str, Any]) -> dict[str, float]:
        """Check per-request overrides with the settings' own range checks -> the values as
        floats; raise ValueError naming the `dllm_` field."""
        out = {}
        for name, value in values.items():
            if name not in self.request_params:
                allowed = ", ".join(f"dllm_{p}" for p in self.request_params) or "none"
                raise ValueError(f"dllm_{name} is not a setting of {self.name} "
                                 f"(per-request settings: {allowed})")
            if not is_finite_number(value):
                raise ValueError(f"dllm_{name} must be a number, got {value!r}")
            try:
                self.config(**{name: float(value)})
            except ValueError as e:
                raise ValueError(f"dllm_{name}: {e}") from None
            out[name] = float(value)
        return out


LOW_CONFIDENCE = Settings("LowConfidence", LowConfidenceConfig, ("threshold",))
JOINT_THRESHOLD = Settings("JointThreshold", JointThresholdConfig,
                           ("threshold", "edit_threshold"))
BUILTIN: dict[str, Settings] = {s.name: s for s in (LOW_CONFIDENCE, JOINT_THRESHOLD)}


def settings_of(algorithm: str) -> Settings:
    """The settings of `--dllm-algorithm NAME`: a built-in's from BUILTIN (no torch); any other
    name through the registry (a plugin's module is imported; unknown names raise
    ValueError listing the known ones)."""
    if algorithm in BUILTIN:
        return BUILTIN[algorithm]
    from dllm_serve.dllm.algorithms import algorithm_class  # the step code, torch included

    return algorithm_class(algorithm).settings()

