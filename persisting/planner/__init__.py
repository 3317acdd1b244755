"""Capacity and bandwidth budget of a shared KV-cache tier, worked exactly.

Operators size a KV tier before they buy memory, disks and NICs. This package does the
arithmetic of that budget (the template of seed 004, sections 1.2-1.3) with exact rational
numbers, so the figures an operator checks by hand come out to the byte, and answers the
questions that follow: what to set ``kv.disk_bytes`` and ``kv.memory_bytes`` to, whether the
disks carry the reads and writes, how many prefixes and requests/s a box holds, and below
which disk bandwidth a hit is slower than recomputing the prefix.

:mod:`.models` knows model shapes and GPUs by name and what a token of KV weighs;
:mod:`.inputs` checks a :class:`PlanInputs`; :mod:`.budget` works the plan out.
"""

from persisting.planner.budget import (
    HARDWARE_LINES,
    PLAN_LINES,
    RECOMPUTE_LINES,
    CapacityPlan,
    HardwarePlan,
    PlanLine,
    RecomputePlan,
    file_bytes,
    plan_capacity,
)
from persisting.planner.inputs import ModelShape, PlanInputs, exact
from persisting.planner.models import (
    DTYPE_BYTES,
    GPU_PRESETS,
    MODEL_PRESETS,
    GpuPreset,
    ModelPreset,
    dtype_bytes,
    find_preset,
    kv_bytes_per_token,
)

__all__ = [
    "DTYPE_BYTES",
    "GPU_PRESETS",
    "HARDWARE_LINES",
    "MODEL_PRESETS",
    "PLAN_LINES",
    "RECOMPUTE_LINES",
    "CapacityPlan",
    "GpuPreset",
    "HardwarePlan",
    "ModelPreset",
    "ModelShape",
    "PlanInputs",
    "PlanLine",
    "RecomputePlan",
    "dtype_bytes",
    "exact",
    "file_bytes",
    "find_preset",
    "kv_bytes_per_token",
    "plan_capacity",
]
