"""Client-side work for the cross-process service tests, run as its own OS process.

``python tests/service/client_tasks.py <task> '<json args>'`` prints ``RESULT <json>`` and
exits with ``os._exit`` (Pulsing 0.1.2 may crash at interpreter exit after a shutdown).
Interactive tasks print ``READY <json>`` and wait for a line on stdin before going on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from persisting.config import PersistingSettings
from persisting.errors import PersistingError
from persisting.kv import Layout, TokenHasher
from persisting.service import KVCacheClient, SyncKVCacheClient
from tests.service.service_helpers import MODEL, key, tensor
from tests.timing import HANG_S, wait_until_async

#: What the ``marker`` command's value is made of (a capture of the wire looks for it).
MARKER = b"persisting-plaintext-marker:0123456789abcdef"


def _settings(args: dict[str, Any]) -> PersistingSettings:
    service = {
        "discovery_timeout_s": args.get("discovery_timeout_s", 15.0),
        "member_retry_s": 0.5,
        "request_timeout_s": 10.0,
    }
    if "passphrase_file" in args:  # where a generated passphrase would be looked for
        service["passphrase_file"] = args["passphrase_file"]
    if "request_timeout_s" in args:
        service["request_timeout_s"] = args["request_timeout_s"]
    if "bulk_encryption" in args:
        service["bulk_encryption"] = args["bulk_encryption"]
    return PersistingSettings(models=[MODEL], service=service)


async def _connect(args: dict[str, Any]) -> KVCacheClient:
    return await KVCacheClient.connect(
        seeds=args["seeds"],
        name=args.get("name", "kvstore"),
        model=args.get("model", MODEL),
        passphrase=args.get("passphrase"),
        settings=_settings(args),
        same_host=args.get("same_host", True),
        min_members=args.get("min_members", 1),
    )


async def roundtrip(args: dict[str, Any]) -> dict[str, Any]:
    """Store tensors of several sizes and kinds, read them back every way, bit-exact."""
    client = await _connect(args)
    base = args.get("base", 0)
    try:
        values = [
            tensor(base + i, tokens=t, hidden=h)
            for i, (t, h) in enumerate([(4, 32), (64, 1024), (256, 1024), (16, 64)])
        ]
        keys = [key(base + i) for i in range(len(values))]
        puts = await client.batched_put(keys, values)
        array = np.arange(3000, dtype=np.float32).reshape(2, 1, 1500, 1)
        raw = bytes(range(256)) * 9000  # > one receive piece
        await client.put(key(base + 10, dtype="float32"), array)
        await client.put(key(base + 11), raw, fmt="binary")
        single = [await client.get(k) for k in keys]
        batched = await client.batched_get([*keys, key(base + 99)])
        out = torch.empty_like(values[2])
        layout = await client.get_into(keys[2], out)
        wrong = Layout((2, 4, 4, 16), "bfloat16", "KV_2LTD", 1024)
        errors: dict[str, str] = {}
        try:
            await client.put(key(base + 12), torch.zeros(2, 8, 1024, 1024, dtype=torch.bfloat16))
        except PersistingError as exc:  # larger than the server's max_value_bytes
            errors["too_large"] = type(exc).__name__
        try:
            await client.put("no-such-model@1@0@1@bfloat16", values[0])
        except PersistingError as exc:
            errors["foreign_key"] = type(exc).__name__
        hasher = TokenHasher(model=MODEL, chunk_size=16)
        tokens = list(range(base * 1000, base * 1000 + 64))
        token_keys = [k for _s, _e, k in hasher.process_tokens(tokens)]
        await client.batched_put(token_keys[:3], [tensor(i) for i in range(3)])
        result = {
            "stored": [p.stored for p in puts],
            "single_exact": all(torch.equal(g, v) for g, v in zip(single, values, strict=True)),
            "batched_exact": all(
                torch.equal(g, v) for g, v in zip(batched[:-1], values, strict=True)
            ),
            "miss_is_none": batched[-1] is None,
            "get_into_exact": layout is not None and torch.equal(out, values[2]),
            "numpy_exact": bool(
                np.array_equal(await client.get(key(base + 10, dtype="float")), array)
            ),
            "bytes_exact": await client.get(key(base + 11)) == raw,
            "expect_mismatch_is_miss": await client.get(keys[0], expect=wrong) is None,
            "lookup_prefix": await client.lookup_prefix([*keys, key(base + 99), *keys]),
            "lookup_tokens": await client.lookup_tokens(tokens, hasher=hasher),
            "contains": [await client.contains(keys[0]), await client.contains(key(base + 99))],
            "errors": errors,
            "same_host": client.same_host(client.members[0]),
            "client_counters": dict(client.counters),
            "server_chunk_size": client.chunk_size,
        }
        result["removed"] = await client.remove(keys[3])
        result["after_remove"] = await client.get(keys[3]) is None
        return result
    finally:
        await client.close()


async def connect_only(args: dict[str, Any]) -> dict[str, Any]:
    try:
        client = await _connect(args)
    except PersistingError as exc:
        return {"connected": False, "error": type(exc).__name__}
    try:
        members = client.members  # what the client saw before its first placement
        value = tensor(5)
        await client.put(key(500), value)
        got = await client.get(key(500))
        exact = got is not None and torch.equal(got, value)
        return {"connected": True, "exact": exact, "members": members}
    finally:
        await client.close()


async def pin_and_hang(args: dict[str, Any]) -> dict[str, Any]:
    """Pin a key, report, then hang until killed (a crashed client's pins must expire)."""
    client = await _connect(args)
    await client.put(key(700), tensor(700))
    pinned = await client.pin(key(700))
    print("READY " + json.dumps({"pinned": pinned}), flush=True)
    await asyncio.Event().wait()  # never set: the test kills this process
    return {}


async def service_stats(args: dict[str, Any]) -> dict[str, Any]:
    """The service counters of every member, optionally after waiting for a condition."""
    client = await _connect(args)
    try:
        field, want = args.get("until", (None, None))
        members: list[dict[str, Any]] = []

        async def reached() -> bool:
            stats = await client.stats()
            members.append(next(iter(stats["members"].values())))
            return field is None or members[-1]["service"].get(field) == want

        await wait_until_async(reached, f"service {field} == {want}")
        member = members[-1]
        if "remove_unforced" in args:
            member["removed_unforced"] = await client.remove(
                key(args["remove_unforced"]), force=False
            )
        return member
    finally:
        await client.close()


async def cluster(args: dict[str, Any]) -> dict[str, Any]:
    """Spread keys over all members, wait while one is killed, then read everything back."""
    client = await _connect(args)
    n = args["keys"]
    try:
        keys = [key(i) for i in range(n)]
        values = [tensor(i) for i in range(n)]
        await client.batched_put(keys, values)
        # Read once: the client now remembers where every value lies in its server's pool,
        # and must still notice that a server is gone (its keys become misses).
        learned = await client.batched_get(keys)
        assert all(v is not None for v in learned)
        owners = {str(k): client.member_of(k) for k in keys}
        # A token lookup over several members: the client hashes, so the client counts.
        hasher = TokenHasher(model=MODEL, chunk_size=16)
        tokens = list(range(4 * 16))
        chunk_keys = [k for _s, _e, k in hasher.process_tokens(tokens)]
        await client.batched_put(chunk_keys, [tensor(500 + i) for i in range(len(chunk_keys))])
        hit = await client.lookup_tokens(tokens, hasher=hasher)
        ready = {
            "members": client.members,
            "owners": owners,
            "hit_tokens": hit,
            "client_hit_tokens": client.counters["lookup_hit_tokens"],
        }
        print("READY " + json.dumps(ready), flush=True)
        gone = sys.stdin.readline().strip()  # the test kills a member, then names it
        got = await client.batched_get(keys)  # the dead member's keys: misses, no error
        singles = [await client.get(k) for k in keys]
        hits = {str(k): g is not None for k, g in zip(keys, got, strict=True)}
        wrong = sum(
            1
            for g, v in zip(got + singles, values + values, strict=True)
            if g is not None and not torch.equal(g, v)
        )
        prefix = await client.lookup_prefix(keys)
        # New puts land on the survivors (the dead member is skipped) and read back.
        fresh = [key(10_000 + i) for i in range(n)]
        puts = await client.batched_put(fresh, [tensor(10_000 + i) for i in range(n)])
        back = await client.batched_get(fresh)
        phase1 = {
            "gone": gone,
            "hits": hits,
            "single_hits": {str(k): g is not None for k, g in zip(keys, singles, strict=True)},
            "wrong": wrong,
            "lookup_prefix": prefix,
            "fresh_stored": sum(p.stored for p in puts),
            "fresh_back": sum(
                b is not None and torch.equal(b, tensor(10_000 + i)) for i, b in enumerate(back)
            ),
            "live_after": client.members,
            "remembered_hits": client.counters["get_hits_remembered"],
            "fresh_owners": [client.member_of(k) for k in fresh],
        }
        print("PHASE1 " + json.dumps(phase1), flush=True)
        sys.stdin.readline()  # the test restarted the member on the same address and disk
        recovered = 0

        async def all_back() -> bool:
            nonlocal recovered
            back = await client.batched_get(keys)
            recovered = sum(
                g is not None and torch.equal(g, v) for g, v in zip(back, values, strict=True)
            )
            return recovered == n

        with contextlib.suppress(AssertionError):  # not all back: the test sees how many
            await wait_until_async(all_back, "every value read back")
        return {"recovered": recovered, "members": client.members}
    finally:
        await client.close()


async def put_keys(args: dict[str, Any]) -> dict[str, Any]:
    client = await _connect(args)
    try:
        keys = [key(i) for i in range(args["start"], args["stop"])]
        puts = await client.batched_put(
            keys, [tensor(i, tokens=4, hidden=16) for i in range(args["start"], args["stop"])]
        )
        return {"stored": sum(p.stored for p in puts)}
    finally:
        await client.close()


async def get_keys(args: dict[str, Any]) -> dict[str, Any]:
    """Get the values ``put_keys`` stored, one by one: hits, misses and errors, and how long
    each get took (reported, never asserted on)."""
    client = await _connect(args)
    outcome: dict[str, Any] = {"hit": 0, "miss": 0, "wrong": 0, "errors": [], "seconds": []}
    try:
        for i in range(args["start"], args["stop"]):
            start = time.monotonic()
            try:
                got = await client.get(key(i))
            except PersistingError as exc:
                outcome["errors"].append(f"{type(exc).__name__}: {exc}")
                continue
            finally:
                outcome["seconds"].append(round(time.monotonic() - start, 3))
            want = tensor(i, tokens=4, hidden=16)
            outcome["hit" if got is not None and torch.equal(got, want) else
                    "miss" if got is None else "wrong"] += 1  # fmt: skip
        outcome["client"] = dict(client.counters)
        return outcome
    finally:
        await client.close()


async def held_copies(args: dict[str, Any]) -> dict[str, Any]:
    """The keys each member holds on disk and its replicator's figures, once they add up
    to ``until`` keys at least (the copies made in the background) and, given
    ``surveyed``, once that member wants ``wanted`` keys and has none due."""
    client = await _connect(args)
    held: dict[str, Any] = {}
    try:

        async def reached() -> bool:
            stats = await client.stats()
            held.clear()
            for addr, member in stats["members"].items():
                store = member["stores"].get(MODEL, {})
                held[addr] = {"keys": store.get("disk_items", 0), "copies": member.get("copies")}
            surveyed = held.get(args.get("surveyed", ""), {}).get("copies") or {}
            if surveyed.get("keys_wanted", 0) < args.get("wanted", 0) or surveyed.get("due"):
                return False  # that member has not judged the keys it surveyed yet
            return sum(m["keys"] for m in held.values()) >= args.get("until", 0)

        await wait_until_async(reached, f"{args.get('until')} keys held", args.get("wait_s", 60))
        return held
    finally:
        await client.close()


async def stalled_readers(args: dict[str, Any]) -> dict[str, Any]:
    """A same-host client that stores ``count`` values of 2 MiB, then asks for each on a
    raw connection to the server's Unix socket (its session's credential) and never reads:
    prints ``READY``, waits for a line on stdin, then reports how many of those connections
    the server has closed."""
    import socket as sockets

    from persisting.service.bulk.frames import pack

    client = await _connect(args)
    try:
        keys = [key(900 + i) for i in range(args["count"])]
        big = [tensor(900 + i, tokens=256, hidden=512) for i in range(args["count"])]
        await client.batched_put(keys, big)
        member = client.cluster.members[client.members[0]]
        assert member.link is not None and member.link.unix
        endpoint = member.link.endpoint
        raws = []
        for k in keys:
            raw = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
            raw.connect(str(endpoint.unix))
            raw.sendall(pack({"id": endpoint.key_id, "secret": endpoint.secret}))
            raw.sendall(pack({"op": "get", "model": MODEL, "keys": [str(k)]}))
            raws.append(raw)
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        closed = 0
        for raw in raws:  # the server closes each at its value's deadline: read to the end
            raw.settimeout(HANG_S)
            try:
                while raw.recv(1 << 16):
                    pass
                closed += 1
            except ConnectionResetError:
                closed += 1
            except OSError:
                pass
            raw.close()
        return {"stalled": len(raws), "closed": closed}
    finally:
        await client.close()


async def timed_puts(args: dict[str, Any]) -> dict[str, Any]:
    """Puts of 2 MiB values one by one: stored, and the seconds each took (reported)."""
    client = await _connect(args)
    try:
        seconds, stored = [], 0
        for i in range(args["count"]):
            start = time.monotonic()
            put = await client.put(key(950 + i), tensor(950 + i, tokens=256, hidden=512))
            seconds.append(round(time.monotonic() - start, 3))
            stored += put.stored
        return {"stored": stored, "seconds": seconds}
    finally:
        await client.close()


async def put_checks(args: dict[str, Any]) -> dict[str, Any]:
    """Through the service: a value whose dtype is not its key's is refused with the store's
    typed error, and a second put of a key is told apart by layout (``conflict``)."""
    client = await _connect(args)
    try:
        refused = ""
        try:
            await client.put(key(700), torch.zeros(2, 4, 16, 64))  # float32, key bfloat16
        except PersistingError as exc:
            refused = f"{type(exc).__name__}: {exc}"
        first = await client.put(key(701), tensor(1))
        same = await client.put(key(701), tensor(2))  # same layout: already stored
        other = await client.put(key(701), tensor(3, tokens=32))  # another layout
        return {
            "refused": refused,
            "first": [first.stored, first.conflict],
            "same": [same.stored, same.conflict],
            "other": [other.stored, other.conflict],
        }
    finally:
        await client.close()


async def present_keys(args: dict[str, Any]) -> dict[str, Any]:
    client = await _connect(args)
    try:
        flags = [await client.contains(key(i)) for i in range(args["start"], args["stop"])]
        stats = await client.stats()
        member = next(iter(stats["members"].values()))
        return {
            "present": sum(flags),
            "events": member.get("events", {}),
            "store": member["stores"][MODEL],
        }
    finally:
        await client.close()


async def sync_roundtrip(args: dict[str, Any]) -> dict[str, Any]:
    """The blocking client, driven from a worker thread (it runs its own event loop)."""

    def work() -> dict[str, Any]:
        client = SyncKVCacheClient.connect(
            seeds=args["seeds"], model=MODEL, settings=_settings(args)
        )
        try:
            values = [tensor(800 + i) for i in range(3)]
            keys = [key(800 + i) for i in range(3)]
            client.batched_put(keys, values)
            pinned = client.pin(keys[0]) and client.unpin(keys[0])
            return {
                "exact": all(
                    torch.equal(g, v) for g, v in zip(client.batched_get(keys), values, strict=True)
                ),
                "lookup": client.lookup_prefix(keys),
                "pinned": pinned,
                "members": client.members,
            }
        finally:
            client.close()

    return await asyncio.to_thread(work)


async def remembered_locations(args: dict[str, Any]) -> dict[str, Any]:
    """Memory hits served from remembered pool locations: exact, never stale, reported."""
    reader = await _connect(args)
    other = await _connect(args)  # a second session, as another client would have
    base = args["base"]
    try:
        keys = [key(base + i) for i in range(4)]
        values = [tensor(base + i, tokens=64, hidden=256) for i in range(4)]
        hits_before_put = _memory_hits(await reader.stats())
        await reader.batched_put(keys, values)  # the reply says where the values lie
        hits_counted_by_put = _memory_hits(await reader.stats()) - hits_before_put
        first = [await reader.get(k) for k in keys]  # served without asking
        told = reader.counters["get_hits_remembered"]
        unseen = await other.batched_get(keys)  # asked: the locations are learned
        asked = other.counters["get_hits_remembered"]
        again = [await other.get(k) for k in keys]  # served without asking
        remembered = other.counters["get_hits_remembered"] - asked
        out = torch.empty_like(values[1])
        into = await reader.get_into(keys[1], out)

        # A third client learns where the writer's values lie from the reply to its
        # first get of another key: its gets of them ask nothing.
        third = await _connect(args)
        try:
            await third.get(keys[3])  # asks (one request), and is told the placements
            learned = third.counters["placements_learned"]
            before = third.counters["get_hits_remembered"]
            told_hits = [await third.get(k) for k in keys[:3]]
            served_told = third.counters["get_hits_remembered"] - before
            # A value replaced after the third client was told: the told place is stale;
            # the generation check catches it, and the new value is what it gets.
            replacement = tensor(base + 99, tokens=64, hidden=256)
            await reader.remove(keys[2])
            await reader.put(keys[2], replacement)
            replaced = await third.get(keys[2])
        finally:
            await third.close()

        await other.remove(keys[0])  # another client removes a value this one remembers
        after_remove = await reader.get(keys[0])

        for _ in range(300):  # enough remembered hits for a touch report of their own
            await reader.get(keys[2])
        server = (await reader.stats())["members"]
        service = next(iter(server.values()))["service"]
        return {
            "exact": all(
                torch.equal(a, b) for a, b in zip(first + unseen + again, values * 3, strict=True)
            ),
            "hits_counted_by_put": hits_counted_by_put,
            "learned": learned,
            "served_told": served_told,
            "told_exact": all(
                g is not None and torch.equal(g, v) for g, v in zip(told_hits, values, strict=False)
            ),
            "replaced_exact": replaced is not None and torch.equal(replaced, replacement),
            "told_by_put": told,
            "asked_by_other": asked,
            "remembered": remembered,
            "get_into_exact": into is not None and torch.equal(out, values[1]),
            "after_remove_is_miss": after_remove is None,
            "stale_locations_dropped": reader.counters["pool_retries"],
            "server_saw_remembered_hits": service.get("get_hits_remembered", 0),
            "reader_counters": dict(reader.counters),  # to read when an assertion fails
        }
    finally:
        await other.close()
        await reader.close()


def _memory_hits(stats: dict[str, Any]) -> int:
    """Memory-tier hits the single member's store has counted."""
    member = next(iter(stats["members"].values()))
    return int(member["stores"][MODEL].get("get_hit_memory", 0))


async def token_lookups(args: dict[str, Any]) -> dict[str, Any]:
    """Store the first chunks of a token sequence, then look it up by tokens."""
    client = await _connect(args)
    try:
        chunk = client.chunk_size  # the server's
        hasher = TokenHasher(model=MODEL, chunk_size=chunk)
        tokens = list(range(args["base"], args["base"] + 5 * chunk + 7))
        keys = [k for _s, _e, k in hasher.process_tokens(tokens)]
        stored = args["stored"]
        await client.batched_put(keys[:stored], [tensor(i, tokens=chunk) for i in range(stored)])
        return {
            "chunk_size": chunk,
            "hit_tokens": await client.lookup_tokens(tokens),
            "with_hasher": await client.lookup_tokens(tokens, hasher=hasher),
        }
    finally:
        await client.close()


async def api_suite(args: dict[str, Any]) -> dict[str, Any]:
    """The KV API contract's behaviour suite (tests/api/kv_api_suite.py) through the async
    client, or through the blocking one driven from a worker thread."""
    from tests.api.kv_api_suite import Threaded, run_suite

    if args["client"] != "SyncKVCacheClient":
        client = await _connect(args)
        try:
            return await run_suite(client, args["base"])
        finally:
            await client.close()

    def connect() -> SyncKVCacheClient:
        return SyncKVCacheClient.connect(seeds=args["seeds"], model=MODEL, settings=_settings(args))

    blocking = await asyncio.to_thread(connect)
    try:
        return await run_suite(Threaded(blocking), args["base"])
    finally:
        await asyncio.to_thread(blocking.close)


async def remote_reader(args: dict[str, Any]) -> dict[str, Any]:
    """A client on another host, driven by the test one command per stdin line, each
    answered with ``DONE <json>``: ``put`` stores ``keys`` values of ``[2, 8, 256, hidden]``
    bf16; ``read`` reads them every way once; ``churn <s>`` reads them one by one for ``s``
    seconds; ``putchurn <s>`` puts fresh keys one by one for ``s`` seconds, then reads each
    back (``stored``, ``put_error``, then hit/miss/wrong as reads count them);
    ``wait`` reads until every value is back (or a hang is evident);
    ``marker`` puts and gets 1 MiB of :data:`MARKER` over and over; ``stats`` the
    servers' figures; ``quit``. Reads count hits, misses, wrong values and
    errors: a failure must be a miss (or a typed error), never a wrong value."""
    client = await _connect(args)
    n, hidden, base = args["keys"], args.get("hidden", 1024), args.get("base", 50_000)

    def value(i: int) -> torch.Tensor:
        return tensor(base + i, tokens=256, hidden=hidden).repeat(1, 2, 1, 1)

    keys = [key(base + i) for i in range(n)]
    values = [value(i) for i in range(n)]
    tally: dict[str, int] = {}

    def count(got: Any, want: torch.Tensor) -> None:
        outcome = "miss" if got is None else ("hit" if torch.equal(got, want) else "wrong")
        tally[outcome] = tally.get(outcome, 0) + 1

    async def read_one(i: int) -> None:
        try:
            count(await client.get(keys[i]), values[i])
        except PersistingError as exc:
            tally["error"] = tally.get("error", 0) + 1
            tally["last_error"] = type(exc).__name__  # type: ignore[assignment]

    try:
        print("READY", flush=True)
        for line in sys.stdin:
            command, *rest = line.split()
            tally.clear()
            result: dict[str, Any] = {}
            if command == "put":
                stored = await client.batched_put(keys, values)
                result["stored"] = sum(p.stored for p in stored)
            elif command == "read":
                for got, want in zip(await client.batched_get(keys), values, strict=True):
                    count(got, want)
                for i in range(n):
                    await read_one(i)
                out = torch.empty_like(values[0])
                layout = await client.get_into(keys[0], out)
                count(out if layout is not None else None, values[0])
            elif command == "putchurn":
                deadline = time.monotonic() + float(rest[0])
                fresh: list[tuple[Any, torch.Tensor]] = []
                while time.monotonic() < deadline:  # real duration: puts for the seconds asked
                    j = len(fresh)
                    fresh.append((key(base + 100_000 + j), values[j % n]))
                    try:
                        put = await client.put(*fresh[-1])
                        outcome = "stored" if put.stored else "not_stored"
                    except PersistingError:
                        outcome = "put_error"  # the member failed: a miss or whole, never part
                    tally[outcome] = tally.get(outcome, 0) + 1
                for k, want in fresh:
                    count(await client.get(k), want)
            elif command == "churn":
                deadline = time.monotonic() + float(rest[0])
                while time.monotonic() < deadline:  # real duration: reads for the seconds asked
                    for i in range(n):
                        await read_one(i)
            elif command == "wait":

                async def all_back() -> bool:
                    got = await client.batched_get(keys)
                    return all(
                        g is not None and torch.equal(g, v)
                        for g, v in zip(got, values, strict=True)
                    )

                with contextlib.suppress(AssertionError):  # not back: no "recovered"
                    await wait_until_async(all_back, "every value read back")
                    tally["recovered"] = n
            elif command == "marker":  # a value whose bytes are easy to find on a wire
                marker = MARKER * ((1 << 20) // len(MARKER))
                put = await client.put(key(base + 999), marker, fmt="binary")
                got = await client.get(key(base + 999))
                result["stored"] = put.stored
                result["exact"] = got is not None and bytes(got) == marker
            elif command == "stats":
                stats = await client.stats()
                result["servers"] = {m: s["service"] for m, s in stats["members"].items()}
                result["members"] = client.members
            elif command == "quit":
                break
            result.update(tally=dict(tally), client=dict(client.counters))
            print("DONE " + json.dumps(result), flush=True)
        return {"closed": True}
    finally:
        await client.close()


TASKS = {
    "remote_reader": remote_reader,
    "api_suite": api_suite,
    "token_lookups": token_lookups,
    "remembered_locations": remembered_locations,
    "sync_roundtrip": sync_roundtrip,
    "roundtrip": roundtrip,
    "connect_only": connect_only,
    "pin_and_hang": pin_and_hang,
    "service_stats": service_stats,
    "cluster": cluster,
    "put_keys": put_keys,
    "get_keys": get_keys,
    "stalled_readers": stalled_readers,
    "timed_puts": timed_puts,
    "put_checks": put_checks,
    "present_keys": present_keys,
    "held_copies": held_copies,
}


def main() -> None:
    task, raw = sys.argv[1], sys.argv[2]
    # The client's own log (members going and coming back) on stderr, as an app shows it.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("persisting.service.client").setLevel(logging.INFO)
    try:
        result = asyncio.run(TASKS[task](json.loads(raw)))
        print("RESULT " + json.dumps(result), flush=True)
        code = 0
    except BaseException as exc:  # report, then exit without Pulsing's exit-time crash
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
