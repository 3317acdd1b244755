"""Garbage over the control protocol and the data path: the service answers every message
with a structured reply (or the transport refuses it), and keeps serving real clients.

    python -m tests.reliability.harness_protocol_fuzz [--examples 300] [--json OUT]

Part one feeds hypothesis-made messages (wrong types, missing and hostile fields, truncated
and garbage bytes, oversized key lists) to the request handler over a real store. Part two
sends hypothesis-made frames (maps of hostile fields, raw bytes, wrong lengths) on
authenticated data connections of a real data-path server: each must get an error frame or
the connection closed, and the server must go on serving. Part three starts a real server
process and sends raw garbage through Pulsing to the named actor, then round-trips tensors
with a KVCacheClient from the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from persisting.errors import PersistingError, error_class_for
from persisting.kv import open_kv_store
from persisting.service.bulk.server import BulkServer
from persisting.service.handler import StorageHandler
from persisting.service.protocol import OPS, PROTOCOL_VERSION, safe_loads
from tests.reliability.rel_common import MODEL, emit, key_text, value
from tests.service.service_helpers import wait_for_log
from tests.timing import wait_until_async

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=30),
    st.binary(max_size=64),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


def messages(live_sid: st.SearchStrategy) -> st.SearchStrategy:
    """Hostile messages, many of them from a live session so they reach the operations."""
    sids = st.one_of(live_sid, st.none(), st.text(max_size=20), SCALARS)
    return st.one_of(_well_formed(live_sid), _well_formed(live_sid), _messages(sids))


KEYS = st.lists(
    st.one_of(st.just(key_text(1)), st.builds(key_text, st.integers(0, 50)), st.text(max_size=60)),
    max_size=8,
)
ARGS = st.one_of(
    VALUES,
    KEYS,
    st.integers(-(1 << 62), 1 << 62),
    st.sampled_from(["KV_2TD", "KV_2LTD", "binary", "nope", ""]),
)


def _well_formed(sid: st.SearchStrategy) -> st.SearchStrategy:
    """A valid envelope from a live session, with hostile arguments for the operation
    (``bye`` left out: it would end the session every later message reuses)."""
    return st.sampled_from(sorted(set(OPS) - {"bye"})).flatmap(
        lambda op: st.fixed_dictionaries(
            {
                "v": st.just(PROTOCOL_VERSION),
                "op": st.just(op),
                "sid": sid,
                "model": st.just(MODEL),
                **{name: ARGS for name in OPS[op].args},
            },
            optional={"expect": VALUES, "touch": KEYS},
        )
    )


def _messages(sids: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        VALUES,
        st.fixed_dictionaries(
            {
                "v": st.one_of(st.just(PROTOCOL_VERSION), SCALARS),
                "op": st.one_of(st.sampled_from(sorted(OPS)), SCALARS),
                "sid": sids,
                "model": st.one_of(
                    st.just(MODEL),
                    st.text(max_size=40),
                    SCALARS,
                    st.sampled_from(["../../etc", "a\x00b", "", "x" * 1000]),
                ),
            },
            optional={
                "keys": st.one_of(
                    VALUES,
                    st.lists(st.text(max_size=60), max_size=10),
                    st.just([key_text(1)] * 5000),
                ),
                "items": VALUES,
                "fmt": VALUES,
                "tokens": VALUES,
                "hasher": VALUES,
                "expect": VALUES,
                "touch": VALUES,
            },
        ),
        st.binary(max_size=200).map(lambda b: pickle.dumps({"v": 1})[: len(b) % 20] + b),
    )


def _check_reply(reply: Any, outcomes: Counter[str]) -> None:
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        outcomes["unstructured_reply"] += 1
        return
    if reply["ok"]:
        outcomes["ok"] += 1
        return
    code = (reply.get("error") or {}).get("code")
    if code == PersistingError.code:
        # The server's catch-all: an exception that was not a typed PersistingError.
        outcomes["untyped_server_error"] += 1
        print(f"untyped: {reply['error'].get('message')}", file=sys.stderr)
    elif not isinstance(code, str) or error_class_for(code) is PersistingError:
        outcomes["unknown_error_code"] += 1
    else:
        outcomes[f"error:{code}"] += 1


def fuzz_handler(root: Path, examples: int, seed: int = 1) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    store = open_kv_store(root, MODEL, memory_bytes=1 << 20, disk_bytes=8 << 20)
    store.put(key_text(1), value(1, 64), fmt="KV_2TD")  # fuzzed requests may remove this
    store.put(key_text(777), value(777, 64), fmt="KV_2TD")  # no fuzzed request names this
    handler = StorageHandler({MODEL: store}, threads=2)
    loop = asyncio.new_event_loop()
    hello = {"v": PROTOCOL_VERSION, "op": "hello", "sid": None, "model": None}
    live = {"sid": loop.run_until_complete(handler.handle(hello))["result"]["sid"]}

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(messages(st.builds(lambda: live["sid"])))
    def one(message: Any) -> None:
        outcomes["messages"] += 1
        reply = loop.run_until_complete(handler.handle(message))
        _check_reply(reply, outcomes)
        if isinstance(message, dict) and message.get("op") == "bye" and reply.get("ok"):
            live["sid"] = loop.run_until_complete(handler.handle(hello))["result"]["sid"]

    try:
        one()
        alive = bool(loop.run_until_complete(handler.handle(hello)).get("ok"))
        intact = np.array_equal(store.get(key_text(777)), value(777, 64))
    finally:
        handler.close()
        loop.close()
        store.close()
    sent = outcomes.pop("messages")
    return {
        "messages": sent,
        "outcomes": dict(sorted(outcomes.items())),
        "handler_alive_after": alive,
        "stored_data_intact": bool(intact),
    }


def _data_frames() -> st.SearchStrategy:
    """Bytes a hostile client sends on an authenticated data connection."""
    fields = {
        "op": st.one_of(st.sampled_from(["get", "put"]), SCALARS),
        "model": st.one_of(st.just(MODEL), SCALARS, st.just("../../etc")),
    }
    request = st.fixed_dictionaries(
        fields,
        optional={
            "keys": st.one_of(VALUES, KEYS),
            "items": st.one_of(
                VALUES,
                st.lists(
                    st.fixed_dictionaries(
                        {"key": ARGS, "layout": VALUES}, optional={"parent": ARGS}
                    ),
                    max_size=3,
                ),
            ),
            "expect": VALUES,
            "pool": VALUES,
            "learn": VALUES,
            "fmt": ARGS,
        },
    )
    framed = st.one_of(request, VALUES).map(_framed)
    return st.one_of(framed, framed, st.binary(max_size=200))


def _framed(message: Any) -> bytes:
    try:
        body = msgpack.packb(message)
    except (OverflowError, TypeError, ValueError):  # an int msgpack cannot hold
        body = b"\xc1"  # a byte msgpack never uses
    return struct.pack("<I", len(body)) + body


def fuzz_data_path(root: Path, examples: int, seed: int = 1) -> dict[str, Any]:
    """Part two (see the module docstring): each example on a fresh authenticated
    connection, which must be answered with error frames or closed."""
    outcomes: Counter[str] = Counter()
    store = open_kv_store(root, MODEL, memory_bytes=1 << 20, disk_bytes=8 << 20)
    store.put(key_text(777), value(777, 64), fmt="KV_2TD")
    handler = StorageHandler({MODEL: store}, threads=2)
    data = BulkServer(handler.state, "127.0.0.1", 0, io_timeout_s=1.0, handshake_s=1.0)
    handler.data = data.start()
    hello = handler.answer({"v": PROTOCOL_VERSION, "op": "hello", "sid": None, "model": None})
    credential = msgpack.packb({"id": hello["result"]["data"]["id"],
                                "secret": hello["result"]["data"]["secret"]})  # fmt: skip
    auth = struct.pack("<I", len(credential)) + credential

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(_data_frames())
    def one(frame: bytes) -> None:
        with socket.create_connection(("127.0.0.1", data.port), timeout=10) as sock:
            sock.sendall(auth)
            sock.recv(64)  # {"ok": true}
            try:
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)  # no more: what the server made of it
                answer = b""
                while chunk := sock.recv(1 << 16):
                    answer += chunk
            except OSError:
                answer = b""
        outcomes[_data_outcome(answer)] += 1

    try:
        one()
        with socket.create_connection(("127.0.0.1", data.port), timeout=10) as sock:
            sock.sendall(auth)
            sock.recv(64)
            request = msgpack.packb({"op": "get", "model": MODEL, "keys": [key_text(777)]})
            sock.sendall(struct.pack("<I", len(request)) + request)
            header = sock.recv(4)
            serving = len(header) == 4
        intact = np.array_equal(store.get(key_text(777)), value(777, 64))
    finally:
        data.close()
        handler.close()
        store.close()
    return {
        "data_frames": examples,
        "data_outcomes": dict(sorted(outcomes.items())),
        "data_path_served_after": serving and bool(intact),
    }


def _data_outcome(answer: bytes) -> str:
    """What a data connection made of a frame: closed, error frames by code, or values."""
    if not answer:
        return "closed"
    try:
        (length,) = struct.unpack("<I", answer[:4])
        frame = msgpack.unpackb(answer[4 : 4 + length])
    except Exception:
        return "unreadable_answer"
    error = frame.get("error") if isinstance(frame, dict) else None
    if isinstance(error, dict):
        code = error.get("code")
        if code == PersistingError.code:
            return "untyped_server_error"
        return f"error:{code}"
    return "answered"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _raw_garbage_then_client(addr: str, rounds: int) -> dict[str, Any]:
    import pulsing
    import torch

    from persisting.config import PersistingSettings, ServiceSettings
    from persisting.service import KVCacheClient
    from persisting.service.passphrase import client_passphrase

    # The server generated a passphrase for loopback use; this same-user process reads it.
    await pulsing.init(
        addr=None, seeds=[addr], passphrase=client_passphrase(None, ServiceSettings())
    )
    system = pulsing.get_system()
    ref = None

    async def resolved() -> bool:  # the server's actor may not be known here yet
        nonlocal ref
        with contextlib.suppress(Exception):
            ref = await system.resolve_named("kvstore")
        return ref is not None

    await wait_until_async(resolved, "the server's kvstore actor")
    outcomes: Counter[str] = Counter()
    garbage: list[Any] = [
        None,
        42,
        "hello",
        b"\x00\xff" * 1000,
        [1, [2, [3]]],
        {"v": 99},
        {"v": PROTOCOL_VERSION, "op": "get", "model": MODEL, "keys": "x"},
        {"v": PROTOCOL_VERSION, "op": "put", "model": "../../x", "items": [], "fmt": "KV_2TD"},
        {"op": "stats"},
        3.5,
        {"v": 1, "op": None},
        pickle.dumps({"v": 1})[:7],
        bytes(range(256)),
    ]
    for i in range(rounds):
        message = garbage[i % len(garbage)]
        try:
            reply = await asyncio.wait_for(ref.ask(message), 10)
            payload = getattr(reply, "payload", None)  # Pulsing may hand back raw bytes
            if payload is not None and not isinstance(reply, dict):
                reply = safe_loads(payload)
            _check_reply(reply, outcomes)
        except (asyncio.TimeoutError, TimeoutError):
            outcomes["timeout"] += 1
        except Exception as exc:
            outcomes[f"transport:{type(exc).__name__}"] += 1
    client = await KVCacheClient.connect(
        seeds=[addr], name="kvstore", model=MODEL, settings=PersistingSettings(models=[MODEL])
    )
    try:
        # float16: the keys (key_text) name half, and a put checks a value against its key
        tensors = [torch.full((2, 2, 8, 16), float(i), dtype=torch.float16) for i in range(4)]
        keys = [key_text(100 + i) for i in range(4)]
        await client.batched_put(keys, tensors)
        got = await client.batched_get(keys)
        served = all(g is not None and torch.equal(g, t) for g, t in zip(got, tensors, strict=True))
    finally:
        await client.close()
    return {
        "raw_messages": rounds,
        "raw_outcomes": dict(sorted(outcomes.items())),
        "served_after_garbage": served,
    }


def fuzz_server(root: Path, rounds: int) -> dict[str, Any]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env.update(
        PERSISTING_STORAGE_PATH=str(root),
        PERSISTING_MODELS=MODEL,
        PERSISTING_SERVICE__ADDR=f"127.0.0.1:{port}",
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
    )
    log = root / "server.log"
    root.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "actors.launch"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for_log(log, "serving", server)
        result = asyncio.run(_raw_garbage_then_client(f"127.0.0.1:{port}", rounds))
        result["server_alive_after"] = server.poll() is None
        return result
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(30)


def run(examples: int, raw_rounds: int, seed: int = 1) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        handler = fuzz_handler(Path(tmp) / "handler", examples, seed)
        data = fuzz_data_path(Path(tmp) / "data", max(1, examples // 10), seed)
        server = fuzz_server(Path(tmp) / "server", raw_rounds)
    bad = sum(
        part.get(kind, 0)
        for part in (handler["outcomes"], server["raw_outcomes"], data["data_outcomes"])
        for kind in (
            "unstructured_reply",
            "unknown_error_code",
            "untyped_server_error",
            "unreadable_answer",
        )
    )
    return {
        "harness": "protocol_fuzz",
        **handler,
        **data,
        **server,
        "bad_replies": bad,
        "seed": seed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--raw", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = run(args.examples, args.raw, args.seed)
    emit(result, args.json)
    ok = (
        result["bad_replies"] == 0
        and result["handler_alive_after"]
        and result["data_path_served_after"]
        and result["served_after_garbage"]
        and result["server_alive_after"]
        and result["stored_data_intact"]
    )
    os._exit(0 if ok else 1)  # Pulsing may crash at interpreter exit after its shutdown


if __name__ == "__main__":
    main()
