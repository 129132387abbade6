"""Triton picks its interpreter when a function is decorated, its own library's at `import triton`:
without a GPU, a file of kernel tests runs itself again in a fresh process started with
TRITON_INTERPRET=1 (numpy; slow, so the shapes are small); on a GPU its tests run natively."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
RUNNABLE = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
in_this_process = pytest.mark.skipif(not RUNNABLE, reason="run in a fresh TRITON_INTERPRET=1 process")


def run_interpreted(path: str) -> None:
    """Run the test file `path` in a TRITON_INTERPRET=1 process; every test but the caller passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--timeout", "600", path]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and re.search(r" passed, 1 skipped( in|, \d+ warnings? in)", done.stdout), done.stdout[
        -4000:
    ]  # the skip: the caller
