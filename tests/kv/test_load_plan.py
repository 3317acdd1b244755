"""Load or recompute, with the figures of an H200 host (docs/gpu.md): an 8B model prefills
~23k tokens/s at 32k context and its 256-token chunks are 32 MiB; pinned host-to-device
copies run ~50 GB/s and its disk reads 0.6-1.2 GB/s."""

from __future__ import annotations

import threading

import pytest

from persisting.errors import ConfigError, InvalidValueError
from persisting.kv.paths.load_plan import HitChunk, TierBandwidth, plan_load

MiB = 1 << 20
GB = 1e9
CHUNK_8B = 32 * MiB  # Llama-3.1-8B, 256 tokens, bf16: 2 * 32 layers * 256 * 1024 * 2 bytes
CHUNK_32B = 64 * MiB  # 64 layers, 8 KV heads of 128
PREFILL_8B = 23_000.0  # tokens/s at 32k context


def measured(**rates: float) -> TierBandwidth:
    """A bandwidth table that has seen 4 GiB of reads per tier at these rates (GB/s)."""
    bandwidth = TierBandwidth()
    for tier, gbps in rates.items():
        for _ in range(128):
            bandwidth.record(tier, CHUNK_8B, CHUNK_8B / (gbps * GB))
    return bandwidth


def chunks(tier: str, count: int, nbytes: int = CHUNK_8B) -> list[HitChunk]:
    return [HitChunk(tier, 256, nbytes)] * count


def test_memory_hits_are_loaded_and_slow_disk_hits_recomputed() -> None:
    bandwidth = measured(memory=50, disk=0.8)
    # A 32 MiB chunk is 11.1 ms of prefill; from memory it loads in 0.7 ms, from disk 42 ms.
    memory = plan_load(chunks("memory", 128), PREFILL_8B, bandwidth)
    assert (memory.load_tokens, memory.load_chunks, memory.recompute_tokens) == (32768, 128, 0)
    assert memory.load_s == pytest.approx(128 * CHUNK_8B / 50e9, rel=1e-6)
    assert memory.saved_s == pytest.approx(32768 / PREFILL_8B - memory.load_s, rel=1e-6)

    disk = plan_load(chunks("disk", 128), PREFILL_8B, bandwidth)
    assert (disk.hit_tokens, disk.load_tokens, disk.recompute_tokens) == (32768, 0, 32768)
    assert disk.load_s == 0 and disk.saved_s == 0

    # 16 chunks still in memory, the rest only on disk: load the memory part only.
    mixed = plan_load(chunks("memory", 16) + chunks("disk", 112), PREFILL_8B, bandwidth)
    assert (mixed.load_tokens, mixed.load_chunks) == (4096, 16)


def test_a_slow_chunk_is_loaded_when_the_fast_ones_after_it_pay_for_it() -> None:
    bandwidth = measured(memory=50, disk=0.8)
    # Two disk chunks cost 2 * (42 - 11.1) ms net; thirty memory chunks after them save
    # 30 * 10.4 ms: loading all 32 is the best prefix.
    plan = plan_load(chunks("disk", 2) + chunks("memory", 30), PREFILL_8B, bandwidth)
    assert plan.load_chunks == 32
    # With only three memory chunks after them it is not.
    plan = plan_load(chunks("disk", 2) + chunks("memory", 3), PREFILL_8B, bandwidth)
    assert plan.load_chunks == 0


def test_a_bigger_model_makes_the_same_disk_worth_reading() -> None:
    # A 32B shape prefills 32k tokens in ~5 s (6.6k tokens/s): 39 ms per 256 tokens. Its
    # 64 MiB chunks read in 61 ms at 1.1 GB/s (recompute), in 34 ms at 2 GB/s (load).
    prefill_32b = 32768 / 4.95
    slow = plan_load(chunks("disk", 128, CHUNK_32B), prefill_32b, measured(disk=1.1))
    fast = plan_load(chunks("disk", 128, CHUNK_32B), prefill_32b, measured(disk=2.0))
    assert slow.load_tokens == 0
    assert fast.load_tokens == 32768 and fast.saved_s > 0.5


def test_a_tier_never_measured_is_loaded_and_a_minimum_saving_can_be_asked() -> None:
    bandwidth = TierBandwidth()
    plan = plan_load(chunks("disk", 4), PREFILL_8B, bandwidth)
    assert plan.load_tokens == 1024 and plan.load_s == 0
    # A prior stands in for measurements until reads replace it.
    primed = TierBandwidth(initial={"disk": 0.5 * GB})
    assert primed.bytes_per_s("disk") == pytest.approx(0.5 * GB)
    assert plan_load(chunks("disk", 4), PREFILL_8B, primed).load_tokens == 0
    # Saving less than asked for is not worth the trouble of loading.
    memory = measured(memory=50)
    saved = plan_load(chunks("memory", 1), PREFILL_8B, memory).saved_s
    assert 0.010 < saved < 0.011
    assert plan_load(chunks("memory", 1), PREFILL_8B, memory, min_saving_s=0.02).load_tokens == 0
    assert memory.plan(chunks("memory", 1), PREFILL_8B).load_tokens == 256


def test_the_average_follows_recent_reads_and_weighs_them_by_size() -> None:
    bandwidth = TierBandwidth(half_life_bytes=256 * MiB)
    for _ in range(20):
        bandwidth.record("disk", 64 * MiB, 64 * MiB / 1e9)  # 1 GB/s
    assert bandwidth.bytes_per_s("disk") == pytest.approx(1e9)
    for _ in range(20):  # 1.25 GiB at 2 GB/s: five half-lives
        bandwidth.record("disk", 64 * MiB, 64 * MiB / 2e9)
    rate = bandwidth.bytes_per_s("disk")
    assert rate is not None and 1.9e9 < rate < 2e9

    # A 1 GiB read at 1 GB/s and a hundred 1 MiB reads at 10 GB/s: the time a large read
    # takes is what matters, so the estimate stays near 1 GB/s (a mean of the per-read
    # rates would say 9.9 GB/s).
    sized = TierBandwidth(half_life_bytes=64 << 30)
    sized.record("disk", 1 << 30, (1 << 30) / 1e9)
    for _ in range(100):
        sized.record("disk", MiB, MiB / 10e9)
    assert sized.bytes_per_s("disk") == pytest.approx(1.085e9, rel=0.01)


def test_bad_samples_are_ignored_and_bad_arguments_refused() -> None:
    bandwidth = TierBandwidth()
    for nbytes, seconds in ((0, 1.0), (MiB, 0.0), (MiB, -1.0), (-5, 1.0), (MiB, float("inf"))):
        bandwidth.record("disk", nbytes, seconds)
    assert bandwidth.bytes_per_s("disk") is None and bandwidth.snapshot() == {}
    with pytest.raises(InvalidValueError, match="recompute_tokens_per_s"):
        plan_load(chunks("disk", 1), 0.0, bandwidth)
    with pytest.raises(ConfigError, match="half_life_bytes"):
        TierBandwidth(half_life_bytes=0)
    assert plan_load([], PREFILL_8B, bandwidth).hit_tokens == 0


def test_records_from_many_threads_all_count() -> None:
    bandwidth = TierBandwidth(half_life_bytes=1 << 60)  # no forgetting: exact sums

    def feed() -> None:
        for _ in range(1000):
            bandwidth.record("memory", 1000, 1e-6)

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bandwidth.snapshot() == {"memory": pytest.approx(1e9)}
