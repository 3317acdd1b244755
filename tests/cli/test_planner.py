"""The capacity planner reproduces budgets worked by hand, to the byte."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from persisting.errors import ConfigError
from persisting.planner import PLAN_LINES, dtype_bytes, kv_bytes_per_token, plan_capacity

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Seed 004, sections 1.2-1.3: GQA, 32 layers, 8 KV heads, head dim 128, BF16; 1,000 prefixes
# of 6K (6144) tokens, 2 replicas, 70% fill, chunk 256, TP 4, 20 rps, 10% of requests
# writing a new 8K prefix, 100 ms staging, 200 Gbps NIC at 70%.
SEED_EXAMPLE = dict(
    layers=32,
    kv_heads=8,
    head_dim=128,
    dtype="bf16",
    prefix_tokens=6144,
    prefixes=1000,
    chunk_size=256,
    tp=4,
    replicas=2,
    fill=0.7,
    rps=20,
    new_prefix_fraction=0.1,
    new_prefix_tokens=8192,
    staging_ms=100,
    nic_gbps=200,
    nic_efficiency=0.7,
)


def test_seed_example_comes_out_exactly() -> None:
    plan = plan_capacity(**SEED_EXAMPLE).to_dict()
    assert plan["bytes_per_token"] == 128 * KiB
    assert plan["bytes_per_prefix"] == 768 * MiB  # 0.75 GiB
    assert plan["total_bytes"] == 750 * GiB
    assert plan["replicated_bytes"] == 1500 * GiB
    # 1500 GiB / 0.7 = 1,610,612,736,000 * 10 / 7 = 2,300,875,337,142.857... -> rounded up
    assert plan["pool_bytes"] == 2_300_875_337_143
    assert round(plan["pool_bytes"] / GiB) == 2143
    assert plan["chunks_per_prefix"] == 24
    assert plan["logical_chunks"] == 24_000
    assert plan["objects"] == 96_000
    assert plan["replica_records"] == 192_000
    assert plan["bytes_per_object"] == 8 * MiB
    assert plan["read_bytes_per_s"] == 15 * GiB
    assert plan["write_bytes_per_s"] == 4 * GiB  # 20 x 10% x 1 GiB x 2
    assert plan["lookups_per_s"] == 1920  # 20 x 24 x 4
    assert plan["inflight_bytes"] == 1536 * MiB  # 15 GiB/s x 100 ms = 1.5 GiB
    assert plan["nic_usable_bytes_per_s"] == 17_500_000_000  # 25 GB/s x 70%
    assert round(plan["nic_usable_bytes_per_s"] / GiB, 2) == 16.30
    assert plan["nic_headroom"] == pytest.approx(17.5e9 / (15 * GiB), rel=1e-15)
    for line in PLAN_LINES:
        value = plan[line.name]
        assert isinstance(value, float if line.unit == "ratio" else int), line.name


def test_mla_model_given_by_bytes_per_token() -> None:
    # DeepSeek-V3-like MLA: 61 layers x (512 latent + 64 rope) x 2 bytes = 70,272 B/token.
    plan = plan_capacity(
        bytes_per_token=61 * 576 * 2,
        prefix_tokens=4096,
        prefixes=500,
        chunk_size=256,
        tp=1,
        replicas=3,
        fill=0.8,
        rps=10,
        new_prefix_fraction=0.25,
        new_prefix_tokens=4096,
        staging_ms=50,
        nic_gbps=400,
        nic_efficiency=0.8,
    )
    assert plan.bytes_per_token == 70_272
    assert plan.bytes_per_prefix == 287_834_112  # 70,272 x 4,096
    assert plan.total_bytes == 143_917_056_000  # x 500
    assert plan.replicated_bytes == 431_751_168_000  # x 3
    assert plan.pool_bytes == 539_688_960_000  # / 0.8, exact
    assert plan.chunks_per_prefix == 16
    assert plan.logical_chunks == 8_000
    assert plan.objects == 8_000
    assert plan.replica_records == 24_000
    assert plan.bytes_per_object == 17_989_632  # 256 x 70,272
    assert plan.read_bytes_per_s == 2_878_341_120  # 10 x 287,834,112
    assert plan.write_bytes_per_s == 2_158_755_840  # 10 x 0.25 x 287,834,112 x 3
    assert plan.lookups_per_s == 160
    assert plan.inflight_bytes == 143_917_056  # x 0.05 s
    assert plan.nic_usable_bytes_per_s == 40_000_000_000  # 50 GB/s x 0.8
    assert plan.nic_headroom == pytest.approx(40e9 / 2_878_341_120, rel=1e-15)
    assert plan.model.attention == "given" and plan.model.objects_per_chunk == 1


def test_70b_class_model_on_tp8() -> None:
    # 80 layers, 8 KV heads, head dim 128, BF16: 2 x 80 x 8 x 128 x 2 = 320 KiB per token.
    plan = plan_capacity(
        layers=80,
        kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        prefix_tokens=8192,
        prefixes=2000,
        chunk_size=512,
        tp=8,
        replicas=2,
        fill=0.75,
        rps=8,
        new_prefix_fraction=0.05,
        new_prefix_tokens=16384,
        staging_ms=200,
        nic_gbps=100,
        nic_efficiency=0.9,
    )
    assert plan.bytes_per_token == 320 * KiB
    assert plan.bytes_per_prefix == 2560 * MiB  # 2.5 GiB
    assert plan.total_bytes == 5000 * GiB
    assert plan.replicated_bytes == 10_000 * GiB
    # 10,000 GiB / 0.75 = 14,316,557,653,333.33... -> rounded up
    assert plan.pool_bytes == 14_316_557_653_334
    assert plan.chunks_per_prefix == 16
    assert plan.logical_chunks == 32_000
    assert plan.objects == 256_000
    assert plan.replica_records == 512_000
    assert plan.bytes_per_object == 20 * MiB  # 512 x 320 KiB / 8
    assert plan.read_bytes_per_s == 20 * GiB
    assert plan.write_bytes_per_s == 4 * GiB  # 8 x 5% x 5 GiB x 2
    assert plan.lookups_per_s == 1024  # 8 x 16 x 8
    assert plan.inflight_bytes == 4 * GiB  # 20 GiB/s x 200 ms
    assert plan.nic_usable_bytes_per_s == 11_250_000_000
    assert plan.nic_headroom == pytest.approx(11.25e9 / (20 * GiB), rel=1e-15)
    assert plan.nic_headroom < 1


def test_fractional_rates_round_demands_up_and_supply_down() -> None:
    plan = plan_capacity(**{**SEED_EXAMPLE, "rps": 0.3, "prefix_tokens": 6000, "nic_gbps": 1.1e-8})
    assert plan.chunks_per_prefix == 24  # 6000 / 256 = 23.4 -> 24
    assert plan.bytes_per_prefix == 6000 * 128 * KiB
    assert plan.read_bytes_per_s == 235_929_600  # 0.3 x 786,432,000, exact
    assert plan.lookups_per_s == 29  # 0.3 x 24 x 4 = 28.8 -> 29
    # 0.3 x 0.1 x 8192 x 131072 x 2 = 64,424,509.44 -> 64,424,510
    assert plan.write_bytes_per_s == 64_424_510
    # 235,929,600 x 0.1 s = 23,592,960 exactly
    assert plan.inflight_bytes == 23_592_960
    # 11 bits/s / 8 x 0.7 = 0.9625 B/s -> 0
    assert plan.nic_usable_bytes_per_s == 0
    assert plan.nic_headroom == pytest.approx(0.9625 / 235_929_600)


def test_typed_decimals_are_read_exactly_whatever_their_python_type() -> None:
    as_float = plan_capacity(**SEED_EXAMPLE)
    for fill in ("0.7", Decimal("0.7"), Fraction(7, 10)):
        assert plan_capacity(**{**SEED_EXAMPLE, "fill": fill}) == as_float


def test_zero_rps_is_a_capacity_only_plan() -> None:
    plan = plan_capacity(**{**SEED_EXAMPLE, "rps": 0})
    assert plan.read_bytes_per_s == plan.write_bytes_per_s == plan.lookups_per_s == 0
    assert plan.inflight_bytes == 0
    assert plan.nic_headroom is None
    assert plan.total_bytes == 750 * GiB


def test_defaults_new_prefix_tokens_to_the_prefix() -> None:
    plan = plan_capacity(
        bytes_per_token=1000, prefix_tokens=100, prefixes=1, rps=2, new_prefix_fraction=0.5
    )
    assert plan.inputs.new_prefix_tokens == 100
    assert plan.write_bytes_per_s == 2 * 0.5 * 100 * 1000  # one replica by default


def test_dtype_names() -> None:
    assert dtype_bytes("bf16") == dtype_bytes("torch.bfloat16") == dtype_bytes("FP16") == 2
    assert dtype_bytes("fp8") == dtype_bytes("float8_e4m3fn") == 1
    assert dtype_bytes("float32") == 4
    assert kv_bytes_per_token(32, 8, 128, "fp8") == 64 * KiB


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"fill": 0}, "fill must be in (0, 1]"),
        ({"fill": 1.5}, "fill must be in (0, 1]"),
        ({"nic_efficiency": 0}, "nic_efficiency must be in (0, 1]"),
        ({"new_prefix_fraction": 1.2}, "new_prefix_fraction must be in [0, 1]"),
        ({"rps": -1}, "rps must be >= 0"),
        ({"rps": float("nan")}, "rps must be finite"),
        ({"rps": "fast"}, "rps must be a number"),
        ({"staging_ms": -5}, "staging_ms must be >= 0"),
        ({"nic_gbps": 0}, "nic_gbps must be > 0"),
        ({"prefix_tokens": 0}, "prefix_tokens must be a whole number >= 1"),
        ({"prefixes": 2.5}, "prefixes must be a whole number >= 1"),
        ({"tp": True}, "tp must be a whole number >= 1"),
        ({"replicas": 0}, "replicas must be a whole number >= 1"),
        ({"new_prefix_tokens": -1}, "new_prefix_tokens must be a whole number >= 0"),
        ({"dtype": "int4"}, "unknown dtype 'int4'"),
        ({"tp": 3}, "tp=3 does not split kv_heads=8 evenly"),
        ({"bytes_per_token": 131072}, "give either bytes_per_token or the model shape"),
        ({"head_dim": None}, "missing head_dim"),
        ({"model": "llama-3.1-8b"}, "give model or the shape, not both"),
        ({"disk_bytes": "lots"}, "disk_bytes must be a size"),
        ({"disk_read": "-3GB/s"}, "disk_read must be"),
        ({"mfu": 2}, "mfu must be in (0, 1]"),
        ({"gpu": "h200"}, "gpu estimates the prefill rate of a model preset"),
        ({"gpu": "tpu9"}, "unknown gpu 'tpu9'"),
    ],
)
def test_impossible_inputs_are_config_errors(change: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_capacity(**{**SEED_EXAMPLE, **change})
    assert message in str(info.value)


def test_chunk_bytes_must_split_over_tp() -> None:
    with pytest.raises(ConfigError, match="does not split evenly over tp=2") as info:
        plan_capacity(bytes_per_token=3, chunk_size=1, tp=2, mla=False, prefix_tokens=1, prefixes=1)
    assert info.value.fields == ("tp", "chunk_size", "bytes_per_token")


@settings(max_examples=200, deadline=None)
@given(
    bytes_per_token=st.integers(1, 1 << 22),
    prefix_tokens=st.integers(1, 1 << 20),
    prefixes=st.integers(1, 100_000),
    chunk_size=st.sampled_from([16, 64, 256, 512, 1024]),
    tp=st.sampled_from([1, 2, 4, 8]),
    replicas=st.integers(1, 4),
    fill_pct=st.integers(1, 100),
    rps=st.integers(0, 10_000),
)
def test_budget_identities_hold(
    bytes_per_token: int,
    prefix_tokens: int,
    prefixes: int,
    chunk_size: int,
    tp: int,
    replicas: int,
    fill_pct: int,
    rps: int,
) -> None:
    plan = plan_capacity(
        bytes_per_token=bytes_per_token * tp,
        mla=False,
        prefix_tokens=prefix_tokens,
        prefixes=prefixes,
        chunk_size=chunk_size,
        tp=tp,
        replicas=replicas,
        fill=Fraction(fill_pct, 100),
        rps=rps,
    )
    assert plan.total_bytes == prefixes * prefix_tokens * bytes_per_token * tp
    assert plan.replicated_bytes == plan.total_bytes * replicas
    # the pool is the smallest whole byte count that holds the data at the fill level
    assert plan.pool_bytes * fill_pct >= plan.replicated_bytes * 100
    assert (plan.pool_bytes - 1) * fill_pct < plan.replicated_bytes * 100
    assert plan.chunks_per_prefix == math.ceil(prefix_tokens / chunk_size)
    assert plan.objects == plan.logical_chunks * tp
    assert plan.bytes_per_object * tp == chunk_size * bytes_per_token * tp
    assert plan.read_bytes_per_s == rps * plan.bytes_per_prefix
    assert plan.lookups_per_s == rps * plan.chunks_per_prefix * tp


# --- models by name, MLA, and the layouts TP makes ----------------------------------------

PRESET_BYTES_PER_TOKEN = {
    # 2 (K, V) x layers x KV heads x head dim x 2 bytes (bf16), from each config.json
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,  # 128 KiB
    "llama-3.1-8b": 2 * 32 * 8 * 128 * 2,
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,  # 320 KiB
    "llama-3.1-70b": 2 * 80 * 8 * 128 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,  # 56 KiB
    "qwen2.5-32b": 2 * 64 * 8 * 128 * 2,  # 256 KiB
    "qwen2.5-72b": 2 * 80 * 8 * 128 * 2,
    "mixtral-8x7b": 2 * 32 * 8 * 128 * 2,
    "mixtral-8x22b": 2 * 56 * 8 * 128 * 2,  # 224 KiB
    # MLA: 61 layers x (512 latent + 64 rope) x 2 bytes, once: no K/V pair
    "deepseek-v3": 61 * 576 * 2,  # 68.625 KiB
}


def test_every_preset_weighs_what_its_shape_says() -> None:
    from persisting.planner import MODEL_PRESETS

    with pytest.raises(ConfigError, match="unknown model 'llama-9b'; presets: llama-3-8b"):
        plan_capacity(model="llama-9b", prefix_tokens=256, prefixes=1)
    assert set(MODEL_PRESETS) == set(PRESET_BYTES_PER_TOKEN)
    for name, expected in PRESET_BYTES_PER_TOKEN.items():
        plan = plan_capacity(model=name, prefix_tokens=256, prefixes=1)
        assert plan.bytes_per_token == expected, name
        assert plan.model.name == name
    by_id = plan_capacity(model="meta-llama/Llama-3.1-70B", prefix_tokens=256, prefixes=1)
    assert by_id.model.name == "llama-3.1-70b"
    fp8 = plan_capacity(model="llama-3.1-8b", dtype="fp8", prefix_tokens=256, prefixes=1)
    assert fp8.bytes_per_token == 64 * KiB


def test_mla_latent_is_stored_once_and_not_split_by_tp() -> None:
    by_flag = plan_capacity(
        layers=61, head_dim=576, mla=True, prefix_tokens=4096, prefixes=500, tp=8
    )
    preset = plan_capacity(model="deepseek-v3", prefix_tokens=4096, prefixes=500, tp=8)
    for plan in (by_flag, preset):
        assert plan.bytes_per_token == 70_272  # ~68.6 KiB, not 137.25 KiB
        assert plan.model.objects_per_chunk == 1 and not plan.model.split_over_tp
        assert plan.objects == plan.logical_chunks == 8_000  # the first rank saves it
        assert plan.bytes_per_object == 256 * 70_272  # the whole latent chunk
        assert plan.lookups_per_s == 0
        assert any("save_only_first_rank" in note for note in plan.notes)
    given = plan_capacity(bytes_per_token=70_272, mla=True, tp=8, prefix_tokens=4096, prefixes=500)
    assert given.objects == 8_000 and given.bytes_per_object == 256 * 70_272


def test_a_latent_shape_without_mla_is_refused_not_doubled() -> None:
    with pytest.raises(ConfigError, match="looks like an MLA latent") as info:
        plan_capacity(layers=61, kv_heads=1, head_dim=576, prefix_tokens=4096, prefixes=1)
    assert "70,272 bytes" in str(info.value) and "mla" in info.value.fields
    # Told that these are K/V heads, the planner counts K and V (and warns).
    plan = plan_capacity(
        layers=61, kv_heads=1, head_dim=576, mla=False, prefix_tokens=4096, prefixes=1
    )
    assert plan.bytes_per_token == 2 * 70_272
    assert any("unusual for an attention head" in w for w in plan.warnings)
    with pytest.raises(ConfigError, match="kv_heads must be 1"):
        plan_capacity(layers=61, kv_heads=8, head_dim=576, mla=True, prefix_tokens=1, prefixes=1)


def test_bytes_per_token_with_tp_must_say_how_it_splits() -> None:
    with pytest.raises(ConfigError, match="say whether TP splits it") as info:
        plan_capacity(bytes_per_token=70_272, tp=8, prefix_tokens=4096, prefixes=1)
    assert set(info.value.fields) >= {"bytes_per_token", "tp", "mla"}
    split = plan_capacity(bytes_per_token=131_072, mla=False, tp=4, prefix_tokens=256, prefixes=1)
    assert split.objects == 4 and split.bytes_per_object == 8 * MiB


def test_more_ranks_than_kv_heads_store_replicated_heads() -> None:
    plan = plan_capacity(model="qwen2.5-7b", tp=8, prefix_tokens=256, prefixes=1)
    assert plan.model.bytes_per_token == 56 * KiB  # one copy of the model's KV
    assert plan.bytes_per_token == 2 * 56 * KiB  # 4 heads on 8 ranks: each saved twice
    assert plan.objects == 8 and plan.bytes_per_object == 256 * 112 * KiB // 8
    assert any("replicate each head on 2 ranks" in w for w in plan.warnings)


def test_replicas_are_a_labelled_what_if() -> None:
    plan = plan_capacity(**SEED_EXAMPLE)
    assert any("what-if" in note and "one copy" in note for note in plan.notes)
    assert next(line for line in PLAN_LINES if line.name == "replicated_bytes").meaning.startswith(
        "what-if"
    )


# --- the hardware: settings, fit, disk bandwidth, worked backwards ---------------------------


def test_hardware_gives_the_settings_and_what_a_box_carries() -> None:
    plan = plan_capacity(
        **SEED_EXAMPLE,
        nodes=2,
        disk_bytes="7.68TB",
        memory_bytes="1TiB",
        disk_read="12GB/s",
        disk_write="6GB/s",
    )
    hw = plan.hardware
    assert hw is not None
    # 7.68e12 x 0.7 = 5,376e9 bytes -> 5,006 GiB; 1 TiB x 0.7 = 716.8 GiB -> 716 GiB
    assert hw.kv_disk_bytes == 5006 * GiB
    assert hw.kv_memory_bytes == 716 * GiB
    assert hw.file_bytes_per_object == 4096 + 8 * MiB  # header + payload
    assert hw.disk_bytes_per_node == 192_000 * (4096 + 8 * MiB) // 2
    assert hw.fits_on_disk is True
    # per prefix: 96 objects (24 chunks x 4 ranks) x 2 replicas x (8 MiB + 4 KiB) on disk,
    # 2 x 768 MiB in memory
    assert hw.prefixes_on_disk == 2 * 5006 * GiB // (96 * 2 * (4096 + 8 * MiB))
    assert hw.prefixes_in_memory == 2 * 716 * GiB // (2 * 768 * MiB)
    share = Fraction(hw.prefixes_in_memory, 1000)
    assert hw.memory_read_share == pytest.approx(float(share))
    reads = 15 * GiB * (1 - share) / 2
    assert hw.disk_read_bytes_per_s == math.ceil(reads)
    assert hw.disk_read_headroom == pytest.approx(float(12 * 10**9 / reads))
    assert hw.disk_write_bytes_per_s == 2 * GiB
    assert hw.disk_write_headroom == pytest.approx(6e9 / (2 * GiB))
    # Worked backwards: each request reads 768 MiB over the NIC (2 nodes x 17.5 GB/s)
    assert hw.max_rps_limit == "NIC"
    assert hw.max_rps == pytest.approx(2 * 17.5e9 / (768 * MiB))
    assert plan.to_dict()["hardware"]["kv_disk_bytes"] == 5006 * GiB


def test_a_disk_too_small_is_reported_and_limits_the_rate() -> None:
    plan = plan_capacity(
        model="llama-3.1-70b",
        prefix_tokens=8192,
        prefixes=2000,
        rps=4,
        disk_bytes="1TB",
        memory_bytes="64GiB",
        disk_read="2GB/s",
    )
    hw = plan.hardware
    assert hw is not None and hw.fits_on_disk is False
    assert hw.prefixes_on_disk < 2000
    assert hw.max_rps_limit == "disk reads"
    per_request = 8192 * 320 * KiB * (1 - Fraction(hw.prefixes_in_memory, 2000))  # type: ignore[arg-type]
    assert hw.max_rps == pytest.approx(float(2 * 10**9 / per_request))


def test_payload_file_size_is_the_stores_own() -> None:
    from persisting.kv.disk.payload_files import file_size
    from persisting.planner import file_bytes

    for n in (1, 4095, 4096, 4097, 8 << 20, 17_989_632):
        assert file_bytes(n) == file_size(n)


# --- load or recompute ----------------------------------------------------------------------


def test_recompute_break_even_from_a_measured_prefill_rate() -> None:
    # The GPU host of the design brief: ~23k tokens/s for an 8B shape at 32k context,
    # disks at 1.2 GB/s: a disk hit is slower than recomputing.
    plan = plan_capacity(
        model="llama-3.1-8b",
        prefix_tokens=32768,
        prefixes=100,
        rps=1,
        prefill_tokens_per_s=23_000,
        disk_read="1.2GB/s",
    )
    r = plan.recompute
    assert r is not None and not r.estimated
    assert r.break_even_bytes_per_s == 23_000 * 128 * KiB  # 3.01 GB/s
    assert r.disk_vs_recompute == pytest.approx(1.2e9 / (23_000 * 128 * KiB))
    assert r.disk_vs_recompute < 1
    assert r.recompute_ms == pytest.approx(32768 / 23_000 * 1000)
    assert r.disk_load_ms == pytest.approx(32768 * 128 * KiB / 1.2e9 * 1000)


def test_recompute_rate_estimated_from_a_gpu_preset() -> None:
    plan = plan_capacity(
        model="llama-3.1-8b", prefix_tokens=32768, prefixes=100, rps=1, gpu="h200", tp=2
    )
    r = plan.recompute
    assert r is not None and r.estimated
    # 2 x 8.03e9 + 32 layers x 32 heads x (128 + 128) x 32,768 tokens
    flops = 2 * 8_030_000_000 + 32 * 32 * 256 * 32768
    assert r.prefill_flops_per_token == flops
    assert r.prefill_tokens_per_s == math.floor(Fraction(2 * 989 * 10**12, 2) / flops)
    assert r.break_even_bytes_per_s == math.ceil(Fraction(2 * 989 * 10**12, 2) / flops * 128 * KiB)
    assert any("estimated from the h200 peak" in note for note in plan.notes)
