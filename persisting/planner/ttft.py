"""What a hit saves in time to first token: the planner's load-or-recompute figures, per token.

A prompt's prefill recomputes every token it does not load. The plan's
:class:`~persisting.planner.budget.RecomputePlan` prices a prefix both ways (its prefill
rate, measured or estimated from a GPU, and its load time from the tier's read bandwidth);
divided by the prefix's tokens, that is what one hit token saves. A request's TTFT is then
``(tokens - hit) / prefill rate + hit x bytes per token / read bandwidth`` (queueing and
decode left out: the same with and without the cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from persisting.planner.budget import CapacityPlan, plan_capacity
from persisting.planner.inputs import PlanInputs


@dataclass(frozen=True)
class TtftModel:
    """Prefill and load costs per token of one engine, as the planner works them out."""

    prefill_tokens_per_s: int
    #: Bytes a hit token loads (all ranks' shares), and the bandwidth they load at
    #: (None: loads taken as free).
    bytes_per_token: int
    read_bytes_per_s: int | None
    #: Whether the prefill rate is an estimate from a GPU's peak (not measured).
    estimated: bool

    @property
    def recompute_s_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s

    @property
    def load_s_per_token(self) -> float:
        return self.bytes_per_token / self.read_bytes_per_s if self.read_bytes_per_s else 0.0

    @property
    def saving_s_per_hit_token(self) -> float:
        """TTFT one hit token saves (negative: loading is slower than recomputing)."""
        return self.recompute_s_per_token - self.load_s_per_token

    def ttft_s(self, tokens: int, hit_tokens: int) -> float:
        """Prefill-bound TTFT of a prompt of ``tokens`` with ``hit_tokens`` loaded."""
        return (tokens - hit_tokens) * self.recompute_s_per_token + (
            hit_tokens * self.load_s_per_token
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "bytes_per_token": self.bytes_per_token,
            "read_bytes_per_s": self.read_bytes_per_s,
            "estimated": self.estimated,
            "saving_ms_per_hit_token": self.saving_s_per_hit_token * 1e3,
        }


def ttft_model(prompt_tokens: int, **inputs: Any) -> TtftModel | None:
    """The planner's prices for prompts of about ``prompt_tokens`` tokens; ``inputs`` are
    :class:`PlanInputs` fields (``model`` or ``bytes_per_token``, ``tp``,
    ``prefill_tokens_per_s`` or ``gpu``, ``mfu``, ``disk_read``). None when no prefill
    rate can be had (neither given nor a GPU with a model preset)."""
    return ttft_of(
        plan_capacity(PlanInputs(prefix_tokens=max(1, prompt_tokens), prefixes=1, rps=1, **inputs))
    )


def ttft_of(plan: CapacityPlan) -> TtftModel | None:
    """The TTFT prices of a plan made with a prefill rate (None without one)."""
    recompute = plan.recompute
    if recompute is None:
        return None
    return TtftModel(
        prefill_tokens_per_s=max(1, recompute.prefill_tokens_per_s),
        bytes_per_token=plan.bytes_per_token,
        read_bytes_per_s=int(plan.inputs.disk_read) if plan.inputs.disk_read else None,
        estimated=recompute.estimated,
    )


__all__ = ["TtftModel", "ttft_model", "ttft_of"]
