"""Stress tests (marker `stress`): their short forms run in the normal test command; set
DLLM_SERVE_STRESS=long for the long forms (see tests/stress/README.md). What each test measured
is printed in the session summary."""

from __future__ import annotations

import pytest
from stress_helpers import LONG, REPORT


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if REPORT:
        terminalreporter.section(f"stress ({'long' if LONG else 'short'} form)")
        for line in REPORT:
            terminalreporter.write_line(line)
