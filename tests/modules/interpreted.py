"""Run a test file's ``interpreted`` cases in a fresh process under the Triton interpreter (``TRITON_INTERPRET=1``
must be set before triton is imported, so it cannot be switched on inside this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional

INSIDE = os.environ.get("TRITON_INTERPRET") == "1"


def run_interpreted(file: str, k: Optional[str] = None, passed: Optional[int] = None, timeout: int = 600,
                    **env: str) -> None:
    """Assert that ``pytest file [-k k]`` passes under the interpreter (with ``passed`` tests, when given)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", file] + (["-k", k] if k else [])
    r = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1", **env}, capture_output=True, text=True,
                       timeout=timeout)
    ok = r.returncode == 0 and (passed is None or f"{passed} passed" in r.stdout)
    assert ok, r.stdout[-6000:] + r.stderr[-3000:]
