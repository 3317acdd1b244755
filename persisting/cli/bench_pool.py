"""``persisting bench replay --members N --member-blocks C``: a trace's hit ratio in a pool
of N storage members, whole and with one lost, for each replication policy
(:mod:`persisting.bench.pool`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from persisting.cli.output import emit, human_bytes, progress_bar
from persisting.errors import ConfigError

if TYPE_CHECKING:
    from persisting.cli.bench_replay import ReplayInput

#: What the table calls each policy.
LABELS = {
    "one": "one copy",
    "all": "two copies of everything",
    "reused": "second copy when reused",
}


def check_pool(members: int | None, member_blocks: int | None) -> bool:
    """Whether a pool was asked for; ConfigError for half of one, or impossible sizes."""
    if members is None and member_blocks is None:
        return False
    if members is None or member_blocks is None:
        raise ConfigError(
            "--members and --member-blocks go together (a pool of N members of C blocks)"
        )
    if members < 2:
        raise ConfigError(f"--members must be at least 2 (a pool that can lose one), got {members}")
    if member_blocks < 1:
        raise ConfigError(f"--member-blocks must be at least 1, got {member_blocks}")
    return True


def run_pool(replay_in: ReplayInput, members: int, member_blocks: int, json_out: bool) -> None:
    from persisting.bench.pool import POLICIES, pool_run
    from persisting.bench.simulate import lru_run

    trace = replay_in.blocks
    requests = [r.blocks for r in trace.requests]
    block_bytes = replay_in.options.object_bytes * replay_in.options.tp
    runs = []
    # each policy plays the first half once, the second half once whole and once per loss
    steps = len(POLICIES) * (len(requests) + (len(requests) - len(requests) // 2) * members)
    with progress_bar("simulating the pool", steps) as advance:
        for policy in POLICIES:
            runs.append(pool_run(requests, members, member_blocks, policy, tick=advance))
    pool_blocks = members * member_blocks
    data: dict[str, Any] = {
        "format": replay_in.fmt,
        "simulated": True,
        "block_tokens": replay_in.options.chunk_size,
        "block_bytes": block_bytes,
        "requests": len(requests),
        "blocks": trace.references,
        "distinct_blocks": trace.distinct_blocks(),
        "members": members,
        "member_blocks": member_blocks,
        "pool_blocks": pool_blocks,
        "pool_bytes": pool_blocks * block_bytes,
        "lost_at_request": len(requests) // 2,
        "window_requests": max(1, len(requests) // 10),
        "lru_token_hit_rate": lru_run(requests, pool_blocks).token_hit_rate,
        "policies": [
            {**run.to_dict(), "held_distinct_bytes": run.held_distinct * block_bytes}
            for run in runs
        ],
    }
    emit(data, json_out, lambda console: _render(console, data))


def _render(console: Console, data: dict[str, Any]) -> None:
    console.print(
        f"A pool of {data['members']} members of {data['member_blocks']:,} blocks: "
        f"{data['pool_blocks']:,} blocks ({human_bytes(data['pool_bytes'])}, "
        f"{data['pool_blocks'] / max(1, data['distinct_blocks']):.1%} of the trace's "
        f"{data['distinct_blocks']:,} distinct blocks); one member lost at request "
        f"{data['lost_at_request']:,} of {data['requests']:,}, each in turn (mean). "
        f"LRU in one cache of {data['pool_blocks']:,} blocks: "
        f"{data['lru_token_hit_rate']:.1%}.",
        highlight=False,
    )
    table = Table(title="Token hit ratio (simulated in blocks)", title_justify="left")
    for column in (
        "policy",
        "whole trace",
        "2nd half",
        "2nd half, one lost",
        "next 10%",
        "next 10%, one lost",
        "whole trace, one lost",
        "distinct blocks held",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in data["policies"]:
        table.add_row(
            LABELS[row["policy"]],
            f"{row['token_hit_rate']:.1%}",
            f"{row['second_half_token_hit_rate']:.1%}",
            f"{row['lost_second_half_token_hit_rate']:.1%} "
            f"({row['lost_second_half_min']:.1%}-{row['lost_second_half_max']:.1%})",
            f"{row['window_token_hit_rate']:.1%}",
            f"{row['lost_window_token_hit_rate']:.1%}",
            f"{row['lost_token_hit_rate']:.1%}",
            f"{row['held_distinct_blocks']:,} ({human_bytes(row['held_distinct_bytes'])})",
        )
    console.print(table)
