"""verl's own virtual environment for the tests that run under it (verl pins a transformers
that TRL's environment does not have): ``.venv/verl-<torch line>``, which ``.ci/bootstrap test``
builds on top of the torch line's environment, or ``$ODC_VERL_PYTHON``."""

from __future__ import annotations

import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = ".".join(torch.__version__.split("+")[0].split(".")[:2])
VENV = os.path.join(ROOT, ".venv", f"verl-{LINE}")
PYTHON = os.environ.get("ODC_VERL_PYTHON", os.path.join(VENV, "bin", "python"))


def verl_python() -> str:
    """The environment's python; skips without it (fails in CI, whose bootstrap builds it)."""
    if not os.path.exists(PYTHON):
        reason = (
            f"{PYTHON} is missing: `bash .ci/bootstrap test` builds verl's environment "
            f"(.venv/verl-{LINE}; it needs PyPI)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return PYTHON


def run_under_verl(script: str, out, timeout: int) -> dict:
    """tests/<script> under verl's python with ``out`` as its argument; returns the JSON it
    wrote there (skips or fails as verl_python does)."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [verl_python(), os.path.join(ROOT, "tests", script), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    with open(out) as f:
        return json.load(f)
