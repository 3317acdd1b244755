"""The service across OS processes on loopback: servers and clients in separate processes.

Every process runs in its own session and is killed (with its group) when the test ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.service_helpers import (
    MODEL,
    REPO,
    free_port,
    key,
    kill_group,
    processes,
    run_client,
    start_pulsing_actor,
    start_serve,
    wait_for_log,
)
from tests.timing import HANG_S, wait_until

pytestmark = pytest.mark.timeout(240)


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def actor_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server started by ``pulsing actor ...``, configured by environment variables."""
    tmp = tmp_path_factory.mktemp("actor-server")
    port = free_port()
    with processes() as procs:
        log = tmp / "server.log"
        procs.append(
            start_pulsing_actor(
                tmp / "root",
                port,
                log,
                PERSISTING_KV__MAX_VALUE_BYTES=str(4 << 20),
                PERSISTING_KV__CHUNK_SIZE="64",
                PERSISTING_SERVICE__METRICS_PORT=str(METRICS_PORT),
            )
        )
        wait_for_log(log, "Started at", procs[0])
        yield f"127.0.0.1:{port}"


def test_a_served_store_maps_its_memory_tier_in_at_start(actor_server: str) -> None:
    """``service.prefault_memory`` (on by default): the first values put after a start land
    in mapped pages, not in pages each faulted on the way in."""
    task = {"seeds": [actor_server], "start": 0, "stop": 0}
    stores: list[dict] = []

    def prefaulted() -> bool:
        stores.append(run_client("present_keys", task)["store"])
        return bool(stores[-1]["memory_prefaulted"] == stores[-1]["memory_capacity"])

    wait_until(prefaulted, "the memory tier mapped in")
    assert stores[-1]["memory_prefaulted"] == stores[-1]["memory_capacity"] > 0


@pytest.mark.slow
def test_a_client_process_round_trips_bit_exact_through_a_pulsing_actor_server(
    actor_server: str,
) -> None:
    for same_host, base in ((True, 0), (False, 100)):
        result = run_client(
            "roundtrip", {"seeds": [actor_server], "same_host": same_host, "base": base}
        )
        assert result["same_host"] is same_host
        assert result["stored"] == [True, True, True, True]
        assert result["server_chunk_size"] == 64  # the server's, not this client's default
        for check in (
            "single_exact",
            "batched_exact",
            "miss_is_none",
            "get_into_exact",
            "numpy_exact",
            "bytes_exact",
            "expect_mismatch_is_miss",
            "removed",
            "after_remove",
        ):
            assert result[check], (check, same_host)
        assert result["lookup_prefix"] == 4  # stops at the missing fifth key
        assert result["lookup_tokens"] == 48  # 3 stored chunks of 16 tokens
        assert result["contains"] == [True, False]
        assert result["errors"] == {"too_large": "CapacityError", "foreign_key": "InvalidKeyError"}
        counters = result["client_counters"]
        assert counters["put_bytes"] > 0  # values moved on data connections
        if same_host:  # memory-tier hits were copied out of the server's shared pool
            assert counters["get_bytes_pool"] > 0 and "get_bytes_remote" not in counters
        else:  # over TCP, as from another host: neither the pool nor the Unix socket
            assert counters["get_bytes_remote"] > 0
            assert "get_bytes_pool" not in counters and "get_bytes_local" not in counters


@pytest.mark.slow
def test_the_server_exports_prometheus_metrics_of_its_stores(actor_server: str) -> None:
    import urllib.request

    run_client("put_keys", {"seeds": [actor_server], "start": 9000, "stop": 9004})
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert f'model="{MODEL}"' in text
    assert "persisting_kv" in text


def _hit_tokens(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("persisting_kv_hit_tokens_total{") and f'model="{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.slow
def test_token_lookups_through_the_service_count_hit_tokens(actor_server: str) -> None:
    import urllib.request

    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        before = _hit_tokens(r.read().decode())
    result = run_client("token_lookups", {"seeds": [actor_server], "base": 50_000, "stored": 3})
    assert result["hit_tokens"] == result["with_hasher"] == 3 * result["chunk_size"]
    with urllib.request.urlopen(url, timeout=10) as r:
        after = _hit_tokens(r.read().decode())
    assert after - before == 2 * 3 * result["chunk_size"]  # both lookups, counted by the server


@pytest.mark.slow
def test_the_blocking_client_works_without_an_event_loop(actor_server: str) -> None:
    result = run_client("sync_roundtrip", {"seeds": [actor_server]})
    assert result == {"exact": True, "lookup": 3, "pinned": True, "members": [actor_server]}


@pytest.mark.slow
def test_the_demo_runs_end_to_end_on_the_embedded_default(tmp_path: Path) -> None:
    code = (
        "import json, os\n"
        "from actors.launch import run_demo\n"
        "from persisting.config import PersistingSettings\n"
        "print('RESULT ' + json.dumps(run_demo(PersistingSettings.load())), flush=True)\n"
        "os._exit(0)\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    for _run in range(2):  # a second run finds the first one's data and events
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        report = json.loads(line[7:])
        assert report["storage_path"] == str(tmp_path / "persisting-data")
        assert report["bit_exact"] and report["same_host_path"]
        assert report["lookup_tokens"] == 1024
        assert report["lookup_tokens_after_evict"] == 768
        assert report["prewarmed_chunks"] == 3
        assert report["events_applied"] == 2  # only this run's events: the position held
        assert report["service"]["get_bytes_message"] == 0


@pytest.mark.slow
def test_pins_of_a_crashed_client_expire_after_the_lease_ttl(
    actor_server: str, tmp_path: Path
) -> None:
    args = json.dumps({"seeds": [actor_server]})
    with processes() as procs:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests/service/client_tasks.py"), "pin_and_hang", args],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)  # type: ignore[arg-type]
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("READY") and json.loads(line[6:]) == {"pinned": True}
        held = run_client("service_stats", {"seeds": [actor_server], "remove_unforced": 700})
        assert held["service"]["pins"] == 1
        assert held["removed_unforced"] is False  # the pin protects it
        kill_group(proc)  # the client dies without unpinning
    after = run_client(
        "service_stats",
        {"seeds": [actor_server], "until": ["pins", 0], "remove_unforced": 700},
    )
    assert after["service"]["pins"] == 0
    assert after["service"]["sessions_expired"] >= 1
    assert after["removed_unforced"] is True  # nothing pins it any more


@pytest.mark.slow
def test_without_the_passphrase_there_is_no_access(tmp_path: Path) -> None:
    port = free_port()
    with processes() as procs:
        log = tmp_path / "server.log"
        procs.append(
            start_serve(tmp_path / "root", port, log, PERSISTING_SERVICE__PASSPHRASE="open-sesame")
        )
        wait_for_log(log, "persisting: serving", procs[0])
        seeds = [f"127.0.0.1:{port}"]
        quick = {"seeds": seeds, "discovery_timeout_s": 4.0}
        # No passphrase given and none generated on this host: refused before any network.
        nowhere = {**quick, "passphrase_file": str(tmp_path / "none")}
        assert run_client("connect_only", nowhere) == {"connected": False, "error": "ConfigError"}
        assert run_client("connect_only", {**quick, "passphrase": "wrong"}) == {
            "connected": False,
            "error": "ServiceUnavailableError",
        }
        assert run_client("connect_only", {**quick, "passphrase": "open-sesame"}) == {
            "connected": True,
            "exact": True,
            "members": seeds,
        }


@pytest.mark.slow
def test_a_server_started_by_pulsings_launcher_speaks_only_tls(actor_server: str) -> None:
    # Pulsing's launcher passes no passphrase; the actor made it start with the generated
    # one, which a client of this user reads (every other test here), and nothing else opens.
    quick = {"seeds": [actor_server], "discovery_timeout_s": 3.0}
    assert run_client("connect_only", {**quick, "passphrase": "guess"}) == {
        "connected": False,
        "error": "ServiceUnavailableError",
    }


@pytest.mark.slow
def test_three_nodes_one_killed_survivors_keys_still_hit_and_its_own_return_with_it(
    tmp_path: Path,
) -> None:
    ports = [free_port() for _ in range(3)]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    n = 60
    with processes() as procs:
        for i, port in enumerate(ports):
            log = tmp_path / f"node{i}.log"
            procs.append(  # one copy of each key: this is the failover of a key's only copy
                start_pulsing_actor(
                    tmp_path / f"root{i}",
                    port,
                    log,
                    seeds=addrs[0] if i else None,
                    PERSISTING_SERVICE__REPLICAS="1",
                )
            )
            wait_for_log(log, "Started at", procs[-1])
        args = json.dumps({"seeds": [addrs[0]], "keys": n, "min_members": 3})
        client_log = tmp_path / "client.log"
        client = subprocess.Popen(
            [sys.executable, str(REPO / "tests/service/client_tasks.py"), "cluster", args],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=client_log.open("w"),
            text=True,
            start_new_session=True,
        )
        procs.append(client)  # type: ignore[arg-type]
        line = client.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("READY"), line
        ready = json.loads(line[6:])
        assert sorted(ready["members"]) == sorted(addrs)
        # Hit tokens are counted where a multi-member lookup happens: in the client.
        assert ready["hit_tokens"] == ready["client_hit_tokens"] == 64
        owners = ready["owners"]
        assert set(owners.values()) == set(addrs)  # every node holds some keys
        victim = addrs[1]
        kill_group(procs[1])  # mid-run: the client is connected and holds sessions
        client.stdin.write(victim + "\n")  # type: ignore[union-attr]
        client.stdin.flush()  # type: ignore[union-attr]
        line = client.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("PHASE1 "), line
        result = json.loads(line[7:])
        # Seeded with the dead node first, a new client finds the cluster through the next;
        # `stats --service` shows the members and their state.
        seeds = [victim, addrs[2]]
        found = run_client("connect_only", {"seeds": seeds, "discovery_timeout_s": 30})
        assert found["connected"] and found["exact"], found
        assert sorted(found["members"]) == sorted([addrs[0], addrs[2]])
        survey = _stats_service(seeds)
        states = {m["addr"]: m["state"] for m in survey["members"]}
        assert states[addrs[0]] == states[addrs[2]] == "up" and states.get(victim) != "up"
        # The victim comes back on the same address and disk: its keys hit again.
        log = tmp_path / "node1-again.log"
        procs.append(
            start_pulsing_actor(
                tmp_path / "root1", ports[1], log, seeds=addrs[0], PERSISTING_SERVICE__REPLICAS="1"
            )
        )
        wait_for_log(log, "Started at", procs[-1])
        out, _ = client.communicate("restarted\n", timeout=120)
        # A fresh client waits for the members the servers see before it places a key.
        fresh = run_client("connect_only", {"seeds": [addrs[0]], "min_members": 1})
        assert sorted(fresh["members"]) == sorted(addrs), fresh
    final = next(json.loads(x[7:]) for x in out.splitlines() if x.startswith("RESULT "))
    # One line when the member went, one when it came back; no Pulsing JSON in them.
    logged = client_log.read_text()
    assert logged.count(f"kv service member {victim} is down") == 1, logged
    assert logged.count(f"kv service member {victim} is back") == 1, logged
    assert "__PULSING_ERROR__" not in logged
    assert final["recovered"] == n
    assert sorted(final["members"]) == sorted(addrs)
    assert result["wrong"] == 0
    assert result["remembered_hits"] > 0  # survivors' keys came from remembered locations
    for k, member in owners.items():
        expected = member != victim  # survivors' keys hit, the victim's are misses
        assert result["hits"][k] is expected, (k, member)
        assert result["single_hits"][k] is expected
    victims_keys = [k for k, m in owners.items() if m == victim]
    assert victims_keys
    first_victim = min(i for i in range(n) if str(key(i)) in victims_keys)
    assert result["lookup_prefix"] == first_victim
    assert result["fresh_stored"] == n and result["fresh_back"] == n
    assert victim not in result["fresh_owners"]


def _stats_service(seeds: list[str]) -> dict:
    args = [str(Path(sys.executable).with_name("persisting")), "stats", "--json"]
    for seed in seeds:
        args += ["--service", seed]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_event_consumer_resumes_after_a_restart_mid_stream(tmp_path: Path) -> None:
    import asyncio

    from actors.kv_events import publish_events
    from persisting.config import PersistingSettings
    from persisting.queue.positions import ConsumerPositions
    from persisting.service.events import evict_event, prewarm_event

    root = tmp_path / "root"
    settings = PersistingSettings(storage_path=root, models=[MODEL])
    port = free_port()
    seeds = {"seeds": [f"127.0.0.1:{port}"]}
    positions = ConsumerPositions(root / "queue" / "kv-events" / "bucket_0")
    first, total = 150, 250
    slow = {"PERSISTING_SERVICE__EVENT_BATCH_RECORDS": "1"}  # one commit per event

    with processes() as procs:
        log = tmp_path / "serve1.log"
        procs.append(start_serve(root, port, log, **slow))
        wait_for_log(log, "persisting: serving", procs[0])
        assert run_client("put_keys", {**seeds, "start": 0, "stop": total + 10})["stored"] == 260
        events = [evict_event(MODEL, [key(i)]) for i in range(first)]
        asyncio.run(publish_events(settings, events))
        wait_until(lambda: (positions.get("kv-service/kvstore") or 0) >= 20, "20 events applied")
        kill_group(procs[0])  # mid-stream: SIGKILL, no clean shutdown
        killed_at = positions.get("kv-service/kvstore")
        assert killed_at is not None and 20 <= killed_at < first
        # More events arrive while the consumer is down.
        events = [evict_event(MODEL, [key(i)]) for i in range(first, total)]
        asyncio.run(publish_events(settings, events))
        asyncio.run(
            publish_events(
                settings, [prewarm_event(MODEL, [key(i) for i in range(total, total + 10)])]
            )
        )

        log = tmp_path / "serve2.log"
        procs.append(start_serve(root, port, log, **slow))
        wait_for_log(log, "persisting: serving", procs[-1])
        wait_until(
            lambda: positions.get("kv-service/kvstore") == total + 1, "every event applied", 90
        )
        result = run_client("present_keys", {**seeds, "start": 0, "stop": total + 10})
    assert result["present"] == 10  # every evicted key is gone, the prewarmed ones stay
    events = result["events"]
    assert int(events["resumed_from"]["0"]) >= killed_at  # resumed, did not replay
    assert events["applied"] <= total + 1 - killed_at + 1  # at most one event twice
    assert events["applied_prewarm"] == 1
    assert result["store"]["memory_items"] >= 10  # prewarmed into the (restarted) memory tier


@pytest.mark.slow
def test_memory_hits_come_from_remembered_pool_locations_and_are_never_stale(
    actor_server: str,
) -> None:
    result = run_client("remembered_locations", {"seeds": [actor_server], "base": 700})
    assert result["exact"] and result["get_into_exact"]
    # the put's reply told the writer where its values lie: its first gets asked nothing,
    # and being told is not a read (no hit counted before any get)
    assert result["told_by_put"] == 4
    assert result["hits_counted_by_put"] == 0
    assert result["asked_by_other"] == 0  # another client must ask once ...
    assert result["remembered"] == 4  # ... and its second pass asked the server nothing
    # a client told of other clients' placements by a reply reads them without asking,
    # and a told place that went stale is caught by the generation check
    assert result["learned"] >= 4
    assert result["served_told"] == 3 and result["told_exact"]
    assert result["replaced_exact"]
    assert result["after_remove_is_miss"]  # removed elsewhere: the old location is not used
    assert result["stale_locations_dropped"] >= 1
    # hits the server never saw as requests still reached its counters (and its LRU)
    assert result["server_saw_remembered_hits"] >= 300, result


def test_a_client_of_another_model_is_refused_at_once_and_leaves_nothing_pending(
    actor_server: str,
) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    # The client's discovery may wait an hour: it returns only because it was refused.
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/service/wrong_model_client.py"), actor_server],
        capture_output=True,
        text=True,
        timeout=HANG_S * 2,
        env=env,
        cwd=REPO,
    )
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[7:])
    assert result["error"] == "AccessDeniedError", result
    assert MODEL in result["message"] and "other/model" in result["message"]
    assert proc.returncode == 0
    assert "Task was destroyed" not in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
