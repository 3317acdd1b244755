"""GPU-only tests: run on a machine with CUDA (scripts/gpu_check.sh), never skipped there.

They live outside the default test paths (pyproject's testpaths is ["tests"]) because CI has
no GPU; run them with ``python -m pytest tests_gpu``. Without CUDA they still import and
collect (so a CPU session can check them), and every one is skipped, saying why.
"""

from __future__ import annotations

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="tests_gpu needs a CUDA device (none here)")
    for item in items:
        item.add_marker(skip)


@pytest.fixture
def root(tmp_path):
    return tmp_path / "root"
