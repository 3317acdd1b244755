"""The budget worked from :class:`~persisting.planner.inputs.PlanInputs`, exactly.

Bytes and byte rates are integers. Where an exact result has a fraction of a byte, a
*demand* (bytes or bandwidth needed) is rounded up and a *supply* (bytes or bandwidth
available, a setting to use) is rounded down, so the budget errs on the safe side. Ratios
(headroom, shares) are the only floats, worked from the exact values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Literal

from persisting.planner.inputs import ModelShape, PlanInputs
from persisting.planner.models import USUAL_HEAD_DIMS, find_gpu, prefill_flops_per_token

Unit = Literal["bytes", "bytes/s", "count", "count/s", "ratio", "share", "ms", "text"]

#: Persisting's payload files: a 4 KiB header, then the payload in 4 KiB blocks (the
#: format's block, ``persisting.kv.disk.payload_files``; a test keeps the two equal).
FILE_BLOCK = 4096
#: Settings are rounded down to whole GiB (MiB below 1 GiB) to read well in a TOML file.
GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class PlanLine:
    """One line of a plan: its JSON name, what kind of figure it is, and what it means."""

    name: str
    unit: Unit
    meaning: str


#: Every workload output of a plan, in reading order, with the one phrase that explains it.
PLAN_LINES: tuple[PlanLine, ...] = (
    PlanLine("bytes_per_token", "bytes", "KV of one token as stored, all ranks (see Model)"),
    PlanLine("bytes_per_prefix", "bytes", "prefix tokens x bytes per token"),
    PlanLine("total_bytes", "bytes", "prefixes x bytes per prefix: the one copy Persisting keeps"),
    PlanLine("replicated_bytes", "bytes", "what-if: total bytes x --replicas"),
    PlanLine("pool_bytes", "bytes", "replicated bytes / fill; the rest: staging, metadata"),
    PlanLine("chunks_per_prefix", "count", "prefix tokens / chunk size, rounded up"),
    PlanLine("logical_chunks", "count", "prefixes x chunks per prefix"),
    PlanLine("objects", "count", "logical chunks x objects per chunk (one per saving rank)"),
    PlanLine("replica_records", "count", "what-if: objects x --replicas"),
    PlanLine("bytes_per_object", "bytes", "chunk size x bytes per token / objects per chunk"),
    PlanLine("read_bytes_per_s", "bytes/s", "rps x bytes per prefix: each reads its prefix"),
    PlanLine("write_bytes_per_s", "bytes/s", "rps x new fraction x new-prefix bytes x replicas"),
    PlanLine("lookups_per_s", "count/s", "rps x chunks per prefix x objects per chunk"),
    PlanLine("inflight_bytes", "bytes", "read rate x staging time: bytes held in staging"),
    PlanLine("nic_usable_bytes_per_s", "bytes/s", "NIC Gbps x 1e9 / 8 x efficiency"),
    PlanLine("nic_headroom", "ratio", "usable NIC / read rate: above 1 the reads fit"),
)

#: What the hardware given (--disk-bytes, --memory-bytes, --disk-read, --disk-write) allows.
HARDWARE_LINES: tuple[PlanLine, ...] = (
    PlanLine("kv_disk_bytes", "bytes", "set kv.disk_bytes to this: node disk x fill"),
    PlanLine("kv_memory_bytes", "bytes", "set kv.memory_bytes to this: node memory x fill"),
    PlanLine("file_bytes_per_object", "bytes", "a payload file: 4 KiB header + 4 KiB blocks"),
    PlanLine("disk_bytes_per_node", "bytes", "objects x replicas x file bytes / nodes"),
    PlanLine("prefixes_on_disk", "count", "prefixes the nodes' disk tiers hold"),
    PlanLine("prefixes_in_memory", "count", "prefixes the nodes' memory tiers hold"),
    PlanLine("memory_read_share", "share", "reads memory serves, if prefixes are equally hot"),
    PlanLine("disk_read_bytes_per_s", "bytes/s", "per node: read rate x (1 - memory share)"),
    PlanLine("disk_read_headroom", "ratio", "disk read bandwidth / disk reads: above 1 fits"),
    PlanLine("disk_write_bytes_per_s", "bytes/s", "per node: write rate / nodes"),
    PlanLine("disk_write_headroom", "ratio", "disk write bandwidth / disk writes: above 1 fits"),
    PlanLine("max_rps", "count/s", "requests/s the nodes carry: the least of the limits"),
    PlanLine("max_rps_limit", "text", "what runs out first at max_rps"),
)

#: When a load beats recomputing the prefix (--prefill-tokens-per-s, or --gpu with --model).
RECOMPUTE_LINES: tuple[PlanLine, ...] = (
    PlanLine("prefill_tokens_per_s", "count/s", "given, or GPUs x peak FLOP/s x MFU / FLOPs"),
    PlanLine("prefill_flops_per_token", "count", "2 x active params + attention over the prefix"),
    PlanLine("recompute_ms", "ms", "prefix tokens / prefill rate"),
    PlanLine("break_even_bytes_per_s", "bytes/s", "prefill rate x bytes per token"),
    PlanLine("disk_load_ms", "ms", "bytes per prefix / disk read bandwidth"),
    PlanLine("disk_vs_recompute", "ratio", "disk read bandwidth / break-even: above 1 a hit wins"),
    PlanLine("nic_vs_recompute", "ratio", "usable NIC / break-even: above 1 a remote hit wins"),
    PlanLine(
        "network_read_bytes_per_s",
        "bytes/s",
        "a remote client's read rate: given (--network-read), else the usable NIC",
    ),
    PlanLine("network_load_ms", "ms", "bytes per prefix / network read bandwidth"),
    PlanLine(
        "network_vs_recompute",
        "ratio",
        "network read / break-even: above 1 a remote hit wins",
    ),
)


@dataclass(frozen=True)
class HardwarePlan:
    """What the nodes hold and carry; None where the input it needs was not given."""

    nodes: int
    kv_disk_bytes: int | None
    kv_memory_bytes: int | None
    file_bytes_per_object: int
    disk_bytes_per_node: int
    prefixes_on_disk: int | None
    prefixes_in_memory: int | None
    memory_read_share: float | None
    disk_read_bytes_per_s: int
    disk_read_headroom: float | None
    disk_write_bytes_per_s: int
    disk_write_headroom: float | None
    max_rps: float | None
    max_rps_limit: str | None
    fits_on_disk: bool | None


@dataclass(frozen=True)
class RecomputePlan:
    """Whether loading a prefix beats recomputing it, per engine (its ``tp`` GPUs)."""

    prefill_tokens_per_s: int
    prefill_flops_per_token: int | None
    estimated: bool
    recompute_ms: float
    break_even_bytes_per_s: int
    disk_load_ms: float | None
    disk_vs_recompute: float | None
    nic_vs_recompute: float
    network_read_bytes_per_s: int
    network_load_ms: float
    network_vs_recompute: float


@dataclass(frozen=True)
class CapacityPlan:
    """The budget: every field named in :data:`PLAN_LINES`, the model's layout, what the
    hardware allows, the recompute break-even, warnings, and the inputs it came from."""

    inputs: PlanInputs
    model: ModelShape
    bytes_per_token: int
    bytes_per_prefix: int
    total_bytes: int
    replicated_bytes: int
    pool_bytes: int
    chunks_per_prefix: int
    logical_chunks: int
    objects: int
    replica_records: int
    bytes_per_object: int
    read_bytes_per_s: int
    write_bytes_per_s: int
    lookups_per_s: int
    inflight_bytes: int
    nic_usable_bytes_per_s: int
    nic_headroom: float | None
    hardware: HardwarePlan | None
    recompute: RecomputePlan | None
    #: Combinations that compute but are probably not what was meant.
    warnings: tuple[str, ...]
    #: What the figures assume, where it is easy to miss.
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        """The outputs under their documented names, then the model, the hardware, the
        recompute break-even, the warnings and the inputs."""
        out: dict[str, Any] = {line.name: getattr(self, line.name) for line in PLAN_LINES}
        out["model"] = asdict(self.model)
        out["hardware"] = asdict(self.hardware) if self.hardware else None
        out["recompute"] = asdict(self.recompute) if self.recompute else None
        out["warnings"] = list(self.warnings)
        out["notes"] = list(self.notes)
        out["inputs"] = self.inputs.to_dict()
        return out


def plan_capacity(inputs: PlanInputs | None = None, /, **fields: Any) -> CapacityPlan:
    """The capacity and bandwidth budget of a KV tier for ``inputs`` (or for the
    :class:`PlanInputs` that ``fields`` make). Impossible inputs raise ConfigError."""
    if inputs is None:
        inputs = PlanInputs(**fields)
    elif fields:
        raise TypeError("give a PlanInputs or its fields, not both")
    return _budget(inputs)


def _budget(i: PlanInputs) -> CapacityPlan:
    m = i.shape
    rps, fill = Fraction(i.rps), Fraction(i.fill)
    bytes_per_prefix = i.prefix_tokens * m.stored_bytes_per_token
    total_bytes = i.prefixes * bytes_per_prefix
    replicated_bytes = total_bytes * i.replicas
    chunks_per_prefix = -(-i.prefix_tokens // i.chunk_size)
    logical_chunks = i.prefixes * chunks_per_prefix
    objects = logical_chunks * m.objects_per_chunk
    read_rate = rps * bytes_per_prefix
    new_prefix_bytes = int(i.new_prefix_tokens or 0) * m.stored_bytes_per_token
    write_rate = rps * Fraction(i.new_prefix_fraction) * new_prefix_bytes * i.replicas
    nic_usable = Fraction(i.nic_gbps) * 10**9 / 8 * Fraction(i.nic_efficiency)
    bytes_per_object = i.chunk_size * m.stored_bytes_per_token // m.objects_per_chunk
    return CapacityPlan(
        inputs=i,
        model=m,
        bytes_per_token=m.stored_bytes_per_token,
        bytes_per_prefix=bytes_per_prefix,
        total_bytes=total_bytes,
        replicated_bytes=replicated_bytes,
        pool_bytes=math.ceil(replicated_bytes / fill),
        chunks_per_prefix=chunks_per_prefix,
        logical_chunks=logical_chunks,
        objects=objects,
        replica_records=objects * i.replicas,
        bytes_per_object=bytes_per_object,
        read_bytes_per_s=math.ceil(read_rate),
        write_bytes_per_s=math.ceil(write_rate),
        lookups_per_s=math.ceil(rps * chunks_per_prefix * m.objects_per_chunk),
        inflight_bytes=math.ceil(read_rate * Fraction(i.staging_ms) / 1000),
        nic_usable_bytes_per_s=math.floor(nic_usable),
        nic_headroom=float(nic_usable / read_rate) if read_rate else None,
        hardware=_hardware(i, objects, bytes_per_object, bytes_per_prefix, read_rate, write_rate)
        if i.hardware_given
        else None,
        recompute=_recompute(i, bytes_per_prefix, nic_usable),
        warnings=tuple(_warnings(i, m, bytes_per_object)),
        notes=tuple(_notes(i, m)),
    )


def file_bytes(payload: int) -> int:
    """Disk a payload file of ``payload`` bytes takes: header plus whole blocks."""
    return FILE_BLOCK + -(-payload // FILE_BLOCK) * FILE_BLOCK


def _hardware(
    i: PlanInputs,
    objects: int,
    bytes_per_object: int,
    bytes_per_prefix: int,
    read_rate: Fraction,
    write_rate: Fraction,
) -> HardwarePlan:
    fill, nodes = Fraction(i.fill), i.nodes
    per_file = file_bytes(bytes_per_object)
    objects_per_prefix = objects // i.prefixes
    file_bytes_per_prefix = objects_per_prefix * per_file * i.replicas
    disk_per_node = math.ceil(Fraction(objects * i.replicas * per_file, nodes))
    disk_setting = _setting(i.disk_bytes, fill)
    memory_setting = _setting(i.memory_bytes, fill)
    on_disk = disk_setting * nodes // file_bytes_per_prefix if disk_setting is not None else None
    in_memory = (
        memory_setting * nodes // (bytes_per_prefix * i.replicas)
        if memory_setting is not None
        else None
    )
    # With every prefix equally popular, memory serves the share of prefixes it holds.
    share = Fraction(min(in_memory, i.prefixes), i.prefixes) if in_memory is not None else None
    disk_reads = read_rate * (1 - (share or 0)) / nodes
    disk_writes = write_rate / nodes
    read_bw = Fraction(i.disk_read) if i.disk_read is not None else None
    write_bw = Fraction(i.disk_write) if i.disk_write is not None else None
    limits: dict[str, Fraction] = {}
    nic = Fraction(i.nic_gbps) * 10**9 / 8 * Fraction(i.nic_efficiency)
    limits["NIC"] = nic * nodes / bytes_per_prefix
    if read_bw is not None and share is not None and share < 1:
        limits["disk reads"] = read_bw * nodes / (bytes_per_prefix * (1 - share))
    written_per_request = (
        Fraction(i.new_prefix_fraction)
        * int(i.new_prefix_tokens or 0)
        * i.shape.stored_bytes_per_token
        * i.replicas
    )
    if write_bw is not None and written_per_request:
        limits["disk writes"] = write_bw * nodes / written_per_request
    limit = min(limits, key=lambda k: limits[k])
    return HardwarePlan(
        nodes=nodes,
        kv_disk_bytes=disk_setting,
        kv_memory_bytes=memory_setting,
        file_bytes_per_object=per_file,
        disk_bytes_per_node=disk_per_node,
        prefixes_on_disk=on_disk,
        prefixes_in_memory=in_memory,
        memory_read_share=float(share) if share is not None else None,
        disk_read_bytes_per_s=math.ceil(disk_reads),
        disk_read_headroom=_ratio(read_bw, disk_reads),
        disk_write_bytes_per_s=math.ceil(disk_writes),
        disk_write_headroom=_ratio(write_bw, disk_writes),
        max_rps=float(limits[limit]),
        max_rps_limit=limit,
        fits_on_disk=disk_per_node <= disk_setting if disk_setting is not None else None,
    )


def _setting(capacity: Any, fill: Fraction) -> int | None:
    """A tier budget for ``capacity`` at ``fill``, rounded down to whole GiB (or MiB)."""
    if capacity is None:
        return None
    budget = capacity * fill
    unit = GiB if budget >= GiB else MiB
    return math.floor(budget / unit) * unit


def _ratio(supply: Fraction | None, demand: Fraction) -> float | None:
    return float(supply / demand) if supply is not None and demand else None


def _recompute(i: PlanInputs, bytes_per_prefix: int, nic_usable: Fraction) -> RecomputePlan | None:
    if not i.recompute_given:
        return None
    flops = None
    if i.prefill_tokens_per_s is not None:
        tokens_per_s = Fraction(i.prefill_tokens_per_s)
    else:
        preset = i.preset
        assert preset is not None and i.gpu is not None  # checked by PlanInputs
        flops = prefill_flops_per_token(preset, i.prefix_tokens)
        tokens_per_s = i.tp * find_gpu(i.gpu).bf16_flops * Fraction(i.mfu) / flops
    per_token = i.shape.stored_bytes_per_token
    break_even = tokens_per_s * per_token
    disk = Fraction(i.disk_read) if i.disk_read is not None else None
    network = Fraction(i.network_read) if i.network_read is not None else nic_usable
    return RecomputePlan(
        prefill_tokens_per_s=math.floor(tokens_per_s),
        prefill_flops_per_token=flops,
        estimated=flops is not None,
        recompute_ms=float(i.prefix_tokens / tokens_per_s * 1000),
        break_even_bytes_per_s=math.ceil(break_even),
        disk_load_ms=float(bytes_per_prefix / disk * 1000) if disk is not None else None,
        disk_vs_recompute=_ratio(disk, break_even),
        nic_vs_recompute=float(nic_usable / break_even),
        network_read_bytes_per_s=math.floor(network),
        network_load_ms=float(bytes_per_prefix / network * 1000),
        network_vs_recompute=float(network / break_even),
    )


def _warnings(i: PlanInputs, m: ModelShape, bytes_per_object: int) -> list[str]:
    """Combinations that compute but make little physical sense (each says why)."""
    out = []
    if m.attention == "gqa" and m.head_dim not in USUAL_HEAD_DIMS:
        out.append(f"head_dim={m.head_dim} is unusual for an attention head (64-256)")
    if m.attention == "gqa" and m.kv_heads is not None and i.tp > m.kv_heads:
        out.append(
            f"tp={i.tp} exceeds kv_heads={m.kv_heads}: engines replicate each head on "
            f"{i.tp // m.kv_heads} ranks, and each rank saves its copy: the tier stores "
            f"{i.tp // m.kv_heads}x the model's KV"
        )
    if bytes_per_object < 1 << 20:
        out.append(
            f"objects of {bytes_per_object} bytes are small: each also costs a 4 KiB file "
            "header, a metadata row and a lookup; a larger chunk_size amortizes them"
        )
    if Fraction(i.fill) > Fraction(95, 100):
        out.append("fill above 0.95 leaves almost nothing for staging, metadata and bursts")
    return out


def _notes(i: PlanInputs, m: ModelShape) -> list[str]:
    """What the figures assume that a reader might not."""
    out = []
    if i.replicas > 1:
        out.append(
            f"replicas={i.replicas} is a what-if for a replicated deployment: Persisting "
            "itself keeps one copy of each chunk"
        )
    if m.attention == "mla" and i.tp > 1:
        out.append(
            f"MLA with tp={i.tp}: every rank holds the same latent, and LMCache saves it "
            "from the first rank only (save_only_first_rank): one object per chunk"
        )
    if i.prefix_tokens % i.chunk_size:
        tail = i.prefix_tokens % i.chunk_size
        out.append(
            f"the last {tail} tokens of a prefix are a partial chunk: counted here, but "
            "stored only with save_unfull_chunk (LMCache and TokenHasher skip them by default)"
        )
    if i.memory_bytes is not None:
        out.append(
            "memory_read_share assumes every prefix is equally popular; a skewed (Zipf) "
            "workload hits memory more: measure it with persisting bench"
        )
    if i.recompute_given and i.prefill_tokens_per_s is None:
        out.append(
            f"prefill rate estimated from the {i.gpu} peak at mfu={float(i.mfu):g} "
            "(measured: an 8B model on one H200 prefills ~23k tokens/s at 32k context); "
            "give prefill_tokens_per_s measured on your engine instead"
        )
    return out


__all__ = [
    "FILE_BLOCK",
    "HARDWARE_LINES",
    "PLAN_LINES",
    "RECOMPUTE_LINES",
    "CapacityPlan",
    "HardwarePlan",
    "PlanLine",
    "RecomputePlan",
    "file_bytes",
    "plan_capacity",
]
