"""A pool of storage members (``persisting.bench.pool``): placement by rendezvous ranking,
copies by policy, a member lost at the middle; and ``bench replay --members`` around it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.bench.pool import POLICIES, Pool, member_names, pool_run
from persisting.bench.simulate import block_key, lru_run
from persisting.cli import app
from persisting.errors import InvalidValueError
from persisting.service.routing import rank_members
from tests.bench.test_simulate import chains
from tests.cli.test_replay_blocks import mooncake

runner = CliRunner()
TRACE = chains(11, 400)
DISTINCT = len({b for r in TRACE for b in r})


def owner(block: int, members: list[str]) -> str:
    return rank_members(block_key(block), members)[0]


def copies_of(pool: Pool, block: int) -> int:
    return sum(block in cache for cache in pool.caches.values())


def test_one_copy_with_room_for_everything_is_an_unbounded_cache() -> None:
    run = pool_run(TRACE, 3, DISTINCT, "one")
    assert run.whole.token_hit_rate == pytest.approx(lru_run(TRACE, DISTINCT).token_hit_rate)
    assert run.held_copies == run.held_distinct == DISTINCT


@pytest.mark.parametrize("policy", POLICIES)
def test_copies_are_made_when_the_policy_says(policy: str) -> None:
    pool = Pool(member_names(3), 10, policy)
    assert pool.request([7]) == 0
    assert copies_of(pool, 7) == (2 if policy == "all" else 1)
    assert pool.request([7]) == 1  # a read hit: "reused" makes its second copy now
    assert copies_of(pool, 7) == (1 if policy == "one" else 2)
    ranking = rank_members(block_key(7), pool.members)
    holders = {m for m, cache in pool.caches.items() if 7 in cache}
    assert holders == set(ranking[: copies_of(pool, 7)])  # the first ranks hold it


def test_a_lost_member_costs_one_copy_exactly_its_own_blocks() -> None:
    # stored, then read (so "reused" has its copies), then the loss at the middle
    trace = [[1, 2, 3]] * 4
    names = member_names(3)
    for policy in POLICIES:
        run = pool_run(trace, 3, 100, policy)
        assert run.whole.hit_blocks == 9 and run.whole_second.hit_blocks == 6
        for index, (window, rest) in enumerate(run.lost):
            second = window + rest
            if policy == "one":
                # the third request hits up to the first block the lost member owned; the
                # blocks from there are stored again, and the fourth hits all three
                owned = [owner(b, names) == names[index] for b in (1, 2, 3)]
                expected = (owned.index(True) if True in owned else 3) + 3
            else:  # both copies were made before the loss: one survives
                expected = 6
            assert second.hit_blocks == expected, (policy, index)


def test_with_room_two_copies_lose_nothing_to_a_loss() -> None:
    for policy in ("all", "reused"):
        run = pool_run(TRACE, 4, DISTINCT, policy)
        if policy == "all":  # every block had both copies before the loss
            assert run.lost_rates("second") == [run.whole_second.token_hit_rate] * 4
        one = pool_run(TRACE, 4, DISTINCT, "one")
        assert run.lost_mean("second") >= one.lost_mean("second")
        assert one.lost_mean("second") < one.whole_second.token_hit_rate


def test_with_tight_capacity_two_copies_hold_fewer_distinct_blocks() -> None:
    tight = DISTINCT // 10
    one, both, reused = (pool_run(TRACE, 3, tight, p) for p in POLICIES)
    assert one.held_copies == one.held_distinct == 3 * tight
    assert both.held_copies == reused.held_copies == 3 * tight  # every member is full
    assert both.held_distinct < one.held_distinct
    assert reused.held_distinct < one.held_distinct
    assert both.whole.token_hit_rate < one.whole.token_hit_rate


def test_losses_are_taken_in_turn_from_the_same_middle() -> None:
    run = pool_run(TRACE, 4, DISTINCT // 8, "one", lose=[2])
    again = pool_run(TRACE, 4, DISTINCT // 8, "one")
    assert len(run.lost) == 1 and run.lost[0] == again.lost[2]
    assert run.whole == again.whole


@pytest.mark.parametrize(
    ("members", "blocks", "policy"), [(1, 10, "one"), (3, 0, "one"), (3, 10, "three")]
)
def test_impossible_pools_are_refused(members: int, blocks: int, policy: str) -> None:
    with pytest.raises(InvalidValueError):
        pool_run(TRACE, members, blocks, policy)


def test_bench_replay_members_prints_the_pool(tmp_path: Path) -> None:
    path = mooncake(tmp_path / "t.jsonl", TRACE)
    tight = DISTINCT // 10
    result = runner.invoke(
        app,
        ["bench", "replay", str(path), "--members", "3", "--member-blocks", str(tight)],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output
    assert "two copies of everything" in result.stdout and "one lost" in result.stdout
    result = runner.invoke(
        app,
        ["bench", "replay", str(path), "--members", "3", "--member-blocks", str(tight), "--json"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["pool_blocks"] == 3 * tight and data["distinct_blocks"] == DISTINCT
    assert data["pool_bytes"] == 3 * tight * data["block_bytes"]
    assert [row["policy"] for row in data["policies"]] == list(POLICIES)
    one = data["policies"][0]
    expected = pool_run(TRACE, 3, tight, "one")
    assert one["token_hit_rate"] == pytest.approx(expected.whole.token_hit_rate)
    assert one["lost_second_half_token_hit_rate"] == pytest.approx(expected.lost_mean("second"))
    assert len(one["lost_second_half_by_member"]) == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--members", "1", "--member-blocks", "10"], "--members must be at least 2"),
        (["--members", "3", "--member-blocks", "0"], "--member-blocks must be at least 1"),
        (["--members", "3"], "go together"),
        (["--members", "3", "--member-blocks", "5", "--memory-bytes", "1MiB"], "--memory-bytes"),
    ],
)
def test_bench_replay_refuses_a_bad_pool(tmp_path: Path, args: list[str], message: str) -> None:
    path = mooncake(tmp_path / "t.jsonl", TRACE[:20])
    result = runner.invoke(app, ["bench", "replay", str(path), *args])
    assert result.exit_code != 0
    assert message in result.output
