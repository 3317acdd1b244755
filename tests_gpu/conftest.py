"""GPU-only tests: run on a machine with CUDA (scripts/gpu_check.sh), never skipped.

They live outside the default test paths (pyproject's testpaths is ["tests"]) because CI has
no GPU; run them with ``python -m pytest tests_gpu``. Without CUDA the run stops at once.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    raise pytest.UsageError("tests_gpu needs a CUDA device (torch.cuda.is_available() is False)")


@pytest.fixture
def root(tmp_path):
    return tmp_path / "root"
