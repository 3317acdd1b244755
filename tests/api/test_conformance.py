"""The KV API contract (persisting.kv.api) holds for all three implementations: the
in-process ``KVStore``, ``KVCacheClient`` against a real server, and ``SyncKVCacheClient``.

One behaviour suite (``kv_api_suite``) runs against each; the clients run it in their own
OS processes (as a serving engine would), against one server started the way ``persisting
serve`` starts it. mypy checks the signatures statically (each class inherits the protocol
it implements); the tests here check at run time what mypy cannot see.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.kv import KVStore, open_kv_store
from persisting.kv.api import CONTRACT, AsyncKVApi, KVApi
from persisting.service import KVCacheClient, SyncKVCacheClient
from tests.api.kv_api_suite import CHECKS, MODEL, Mirrored, run_suite
from tests.service.service_helpers import (
    free_port,
    processes,
    run_client,
    start_serve,
    wait_for_log,
)

pytestmark = pytest.mark.timeout(300)

ALL_OK = {check.__name__: "ok" for check in CHECKS}
MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server, started the way ``persisting serve`` starts it."""
    tmp = tmp_path_factory.mktemp("api-server")
    port = free_port()
    with processes() as procs:
        log = tmp / "serve.log"
        procs.append(start_serve(tmp / "root", port, log))
        wait_for_log(log, "persisting: serving", procs[0])
        yield f"127.0.0.1:{port}"


def test_the_in_process_store_keeps_the_contract(root: Path) -> None:
    """Through its derived async mirror (``aput``...), which runs its blocking methods."""
    with open_kv_store(root, MODEL, memory_bytes=64 * MiB, disk_bytes=256 * MiB) as store:
        assert asyncio.run(run_suite(Mirrored(store), base=0)) == ALL_OK


@pytest.mark.slow
@pytest.mark.parametrize(
    ("client", "same_host", "base"),
    [
        ("KVCacheClient", True, 100_000),
        ("KVCacheClient", False, 200_000),  # the message path, as from another host
        ("SyncKVCacheClient", True, 300_000),
    ],
    ids=["async-same-host", "async-messages", "sync"],
)
def test_each_client_keeps_the_contract(
    server: str, client: str, same_host: bool, base: int
) -> None:
    args = {"seeds": [server], "client": client, "same_host": same_host, "base": base}
    assert run_client("api_suite", args, timeout_s=240) == ALL_OK


def _methods(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_the_contract_lists_what_the_protocols_declare() -> None:
    assert _methods(KVApi) == _methods(AsyncKVApi) == set(CONTRACT)


@pytest.mark.parametrize(
    ("implementation", "protocol"),
    [(KVStore, KVApi), (SyncKVCacheClient, KVApi), (KVCacheClient, AsyncKVApi)],
    ids=lambda v: getattr(v, "__name__", ""),
)
def test_each_class_implements_every_method_of_its_protocol(
    implementation: type, protocol: type
) -> None:
    """Every method is the class's own (none falls back to the protocol's empty body), is
    async exactly where the protocol's is, and accepts every argument the protocol names,
    the same way and with the same default."""
    assert issubclass(implementation, protocol)
    for name in CONTRACT:
        ours, theirs = getattr(implementation, name), getattr(protocol, name)
        assert ours is not theirs, f"{implementation.__name__}.{name} is not implemented"
        assert _awaited(ours) == inspect.iscoroutinefunction(theirs), name
        accepted = inspect.signature(ours).parameters
        for param in inspect.signature(theirs).parameters.values():
            assert param.name in accepted, (name, param.name)
            mine = accepted[param.name]
            assert mine.default == param.default, (name, param.name)
            if param.kind is param.KEYWORD_ONLY:
                assert mine.kind in (mine.KEYWORD_ONLY, mine.POSITIONAL_OR_KEYWORD), name
            else:
                assert mine.kind is param.kind, (name, param.name)


def _awaited(method: Any) -> bool:
    """Whether calling ``method`` gives a coroutine (derived methods say so by name)."""
    if inspect.iscoroutinefunction(method):
        return True
    return type(method).__name__ == "in_thread"


def test_the_derived_mirrors_carry_the_original_signatures(root: Path) -> None:
    with open_kv_store(root, MODEL, memory_bytes=MiB, disk_bytes=0) as store:
        for name in CONTRACT:
            mirror = getattr(store, "a" + name)
            assert inspect.signature(mirror) == inspect.signature(getattr(store, name)), name
            assert mirror.__name__ == "a" + name
        assert isinstance(store, KVApi)
    assert inspect.signature(SyncKVCacheClient.put) == inspect.signature(KVCacheClient.put)
    assert SyncKVCacheClient.get.__doc__ == KVCacheClient.get.__doc__
