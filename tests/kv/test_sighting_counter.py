"""The disk tier's sighting counter: a poke is counted on its thread, close counts what is
left and returns even while a count is under way."""

from __future__ import annotations

import threading

from persisting.kv.eviction.sighting_counter import SightingCounter


def test_a_poke_is_counted_on_the_counters_thread() -> None:
    counted = threading.Event()
    threads: list[str] = []

    def count() -> None:
        threads.append(threading.current_thread().name)
        counted.set()

    counter = SightingCounter(count, delay_s=0.0)
    try:
        counter.poke()
        assert counted.wait(30)
        assert threads[0] == "persisting-kv-sightings"
    finally:
        counter.close()


def test_close_while_a_count_is_under_way_returns_and_counts_once_more() -> None:
    entered, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def count() -> None:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            entered.set()
            release.wait(30)

    counter = SightingCounter(count, delay_s=0.0)
    counter.poke()
    assert entered.wait(30)
    closing = threading.Thread(target=counter.close)
    closing.start()
    counter.poke()  # a read racing the close: counted by close's own count
    release.set()
    closing.join(60)
    assert not closing.is_alive()
    assert calls[-1] == closing.name  # what was left, counted by close itself
    assert len(calls) in (2, 3)


def test_a_counter_never_poked_starts_no_thread_and_closes() -> None:
    calls: list[int] = []
    before = threading.active_count()
    counter = SightingCounter(lambda: calls.append(1))
    assert threading.active_count() == before
    counter.close()
    assert calls == [1]
