"""The README's test command collects every layer of tests, and CI's lint reads them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_test_command_collects_the_multi_process_tests():
    """``python -m pytest tests`` must enter tests/dist: pytest's default
    ``norecursedirs`` skips any directory named ``dist``."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    for layer in ("unit", "dist", "e2e"):
        assert f"tests/{layer}/" in out, layer
    assert "tests/dist/test_dmuon.py::" in out


def test_the_lint_command_reads_the_multi_process_tests():
    """``ruff check .`` (in .ci/run) must enter tests/dist: ruff's default
    ``exclude`` skips any directory named ``dist``."""
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "tests/dist/harness.py" in out and "ray_fsdp_backend/__init__.py" in out
