"""The bookkeeping of copies, without a cluster: where a key's other copies go, the backlog
of keys to check (each once, oldest first, bounded, all again when the members change),
and the pace copies are sent at."""

from __future__ import annotations

import threading

import pytest

from persisting.service.replication import CopyBacklog, Pacer, copy_targets
from persisting.service.routing import rank_members

MEMBERS = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1"]
KEYS = [f"m@1@0@{i:x}@bfloat16" for i in range(200)]


def test_a_keys_other_copies_go_to_the_rest_of_its_first_ranks() -> None:
    for key in KEYS:
        ranking = rank_members(key, MEMBERS)
        owner, second = ranking[0], ranking[1]
        assert copy_targets(key, MEMBERS, owner, 2) == [second]
        assert copy_targets(key, MEMBERS, second, 2) == [owner]
        # a member outside the first ranks (it took the key while the owner was away)
        # sends it to both
        assert copy_targets(key, MEMBERS, ranking[3], 2) == ranking[:2]
        assert copy_targets(key, MEMBERS, owner, 1) == []
        assert copy_targets(key, MEMBERS, owner, 3) == ranking[1:3]
    # fewer live members than replicas: every other live member
    assert copy_targets(KEYS[0], MEMBERS[:2], MEMBERS[0], 3) == [MEMBERS[1]]
    assert copy_targets(KEYS[0], MEMBERS[:1], MEMBERS[0], 2) == []


def test_the_backlog_checks_each_key_once_until_the_members_change() -> None:
    backlog = CopyBacklog()
    assert backlog.want("a", KEYS[:10]) == 10
    assert backlog.want("a", KEYS[:12]) == 2  # those wanted already are not due again
    assert backlog.want("b", KEYS[:3]) == 3
    first = backlog.take(5, 0.0)
    assert first == [("a", k) for k in KEYS[:5]]  # oldest first
    rest = backlog.take(100, 0.0)
    assert len(rest) == 10 and backlog.due == 0
    assert backlog.take(10, 0.0) == []
    assert backlog.recheck() == 15  # every wanted key is due again
    backlog.forget("a", KEYS[:12])
    assert backlog.due == 3 and backlog.wanted("a") == 0 and backlog.wanted("b") == 3


def test_the_backlog_is_bounded_and_forgets_the_oldest() -> None:
    backlog = CopyBacklog(max_wanted=4)
    backlog.want("a", KEYS[:6])
    assert backlog.wanted("a") == 4
    backlog.take(100, 0.0)
    backlog.recheck()
    assert [k for _m, k in backlog.take(100, 0.0)] == KEYS[2:6]


def test_a_waiting_take_wakes_when_a_key_is_wanted() -> None:
    backlog = CopyBacklog()
    got: list[list[tuple[str, str]]] = []
    taker = threading.Thread(target=lambda: got.append(backlog.take(10, 30.0)))
    taker.start()
    backlog.want("a", KEYS[:1])
    taker.join(timeout=10.0)
    assert not taker.is_alive() and got == [[("a", KEYS[0])]]


def test_the_pacer_holds_the_stated_rate() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = Pacer(100, clock=lambda: now[0], sleep=sleep)
    pacer.spend(100)  # a full bucket: no wait
    assert slept == []
    pacer.spend(50)
    assert slept == [pytest.approx(0.5)]
    for _ in range(10):
        pacer.spend(100)
    assert now[0] == pytest.approx(10.5)  # 1,150 bytes at 100/s, the first 100 free


def test_keys_due_together_are_taken_together() -> None:
    backlog = CopyBacklog(gather_s=0.4)
    got: list[list[tuple[str, str]]] = []
    taker = threading.Thread(target=lambda: got.append(backlog.take(10, 30.0)))
    taker.start()
    backlog.want("a", KEYS[:1])
    backlog.want("a", KEYS[1:3])  # while the first waits for company
    taker.join(timeout=10.0)
    assert got == [[("a", k) for k in KEYS[:3]]]
    backlog.want("a", KEYS[3:13])  # as many as a step takes: no waiting for more
    assert backlog.take(10, 30.0) == [("a", k) for k in KEYS[3:13]]


def test_surveyed_keys_are_asked_about_until_they_are_known_to_be_wanted() -> None:
    backlog = CopyBacklog(gather_s=0.0)
    backlog.want("m", ["a"])
    assert backlog.survey("m", ["a", "b", "c"]) == 2  # "a" is known to be wanted
    batch = backlog.take(10, 0.0)
    assert batch == [("m", "a"), ("m", "b"), ("m", "c")]
    assert backlog.unsure(batch) == {("m", "b"), ("m", "c")}
    backlog.want("m", ["b"])  # another member holds it
    assert backlog.unsure(batch) == {("m", "c")}
    backlog.take(10, 0.0)  # "b" is due to be copied
    assert backlog.recheck() == 3  # "a" and "b" wanted, "c" still unknown: all due again
    assert backlog.unsure(backlog.take(10, 0.0)) == {("m", "c")}
    backlog.forget("m", ["c"])  # evicted here
    assert backlog.recheck() == 2 and backlog.wanted("m") == 2
