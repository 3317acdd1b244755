"""Tests wait on events, not on time (``tests/timing.py``): no test asserts how long
something took, none writes a polling loop of its own (a ``while`` around a clock or a
sleep: :func:`tests.timing.wait_until` and :func:`~tests.timing.wait_until_async` are the
one), and a test sleeps only where a real duration is what it is about -- listed in
:data:`REAL_DURATIONS`, each sleep with a comment on its line saying so.

Read from the source (``ast``) of every module under ``tests/``. ``asyncio.sleep(0)`` (a
turn of the event loop, not a wait) is not a sleep.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
#: The helpers themselves, and this file (its samples break the rules on purpose).
EXEMPT = {"tests/timing.py", "tests/test_timing_rules.py"}
#: ``time`` functions that read a clock.
CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns"}
#: Names that hold a duration when an assertion orders them.
DURATION_NAMES = {"elapsed", "elapsed_s", "seconds", "took", "duration"}

#: (module, function) -> why time itself is the subject there: the only places a test may
#: sleep or loop on a clock. A function's path is dotted through its enclosing functions
#: and classes.
REAL_DURATIONS: dict[tuple[str, str], str] = {
    ("tests/queue/queue_procs.py", "pulsing_producer"): "records arrive one by one as it reads",
    (
        "tests/queue/test_queue_backend.py",
        "test_a_stream_waits_at_most_its_timeout_in_all.go.trickle",
    ): "a trickle of records",
    ("tests/reliability/harness_cancelled_puts.py", "_run"): "puts cancelled mid-way",
    ("tests/reliability/harness_kv_budget.py", "writer"): "writes for the seconds asked",
    ("tests/reliability/harness_kv_budget.py", "run_case"): "usage sampled as writers run",
    ("tests/reliability/harness_kv_concurrency.py", "worker"): "works for the seconds asked",
    ("tests/reliability/harness_kv_concurrency.py", "run"): "the peak sampled as workers run",
    ("tests/reliability/rel_common.py", "run_and_kill"): "a kill at a chosen point",
    ("tests/service/client_tasks.py", "remote_reader"): "churns for the seconds asked",
    (
        "tests/service/test_data_path.py",
        "test_the_handshake_deadline_holds_however_slowly_bytes_come",
    ): "a trickling handshake",
    (
        "tests/service/test_data_path.py",
        "test_a_reader_that_reads_slowly_or_not_at_all_is_dropped_by_the_deadline",
    ): "a slow reader",
    ("tests/service/test_data_path.py", "Relay._pump"): "a relay that trickles",
    (
        "tests/service/test_data_path.py",
        "test_a_get_cancelled_mid_transfer_closes_its_connection_and_writes_no_more",
    ): "a window for a late write",
    (
        "tests/service/test_remote_hosts.py",
        "test_connections_killed_mid_transfer_are_misses_never_wrong_values",
    ): "kills spread over the traffic",
    (
        "tests/service/test_remote_hosts.py",
        "test_connections_killed_mid_put_store_whole_values_or_nothing",
    ): "kills spread over the traffic",
}
#: Polling loops in modules other engineers had not landed when these rules came (issue
#: 48 item 6): each is to move onto tests.timing.wait_until, and its entry to go.
NOT_YET_MOVED: set[tuple[str, str]] = {("tests/engines/vllm_worker_kit.py", "Kit._collect")}


@dataclass
class Findings:
    """What one module does with time: (line, function) of each finding."""

    sleeps: list[tuple[int, str]] = field(default_factory=list)
    polling_loops: list[tuple[int, str]] = field(default_factory=list)
    timed_asserts: list[tuple[int, str]] = field(default_factory=list)


def _imported_from(tree: ast.AST, module: str) -> dict[str, str]:
    """Local name -> name in ``module`` for each ``from module import ...``."""
    return {
        alias.asname or alias.name: alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module
        for alias in node.names
    }


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes under ``node``, not entering functions, lambdas or classes in it."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield child
        stack.extend(ast.iter_child_nodes(child))


class _Scan(ast.NodeVisitor):
    def __init__(self, tree: ast.Module):
        self.found = Findings()
        self._scope: list[str] = []
        self._from_time = _imported_from(tree, "time")
        self._from_asyncio = _imported_from(tree, "asyncio")
        #: Names assigned from a clock reading anywhere in the module (``started``,
        #: ``deadline``, ``elapsed``...): an assertion on one asserts on time.
        self._clocked = {
            name.id
            for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
            and node.value is not None
            and self._reads_clock(node.value)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for name in ast.walk(target)
            if isinstance(name, ast.Name)
        }

    def _is_clock(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            return f.value.id == "time" and f.attr in CLOCKS
        return isinstance(f, ast.Name) and self._from_time.get(f.id) in CLOCKS

    def _reads_clock(self, node: ast.AST) -> bool:
        return any(self._is_clock(n) for n in ast.walk(node))

    def _is_sleep(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        sleep = (
            isinstance(f, ast.Attribute)
            and isinstance(f.value, ast.Name)
            and f.value.id in ("time", "asyncio")
            and f.attr == "sleep"
        ) or (
            isinstance(f, ast.Name)
            and "sleep" in (self._from_time.get(f.id), self._from_asyncio.get(f.id))
        )
        zero = bool(node.args) and isinstance(node.args[0], ast.Constant) and not node.args[0].value
        return sleep and not zero

    def _where(self) -> str:
        return ".".join(self._scope) or "<module>"

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        if self._is_sleep(node):
            self.found.sleeps.append((node.lineno, self._where()))
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        looks = [*ast.walk(node.test), *_own_nodes(node)]
        if any(self._is_clock(n) or self._is_sleep(n) for n in looks):
            self.found.polling_loops.append((node.lineno, self._where()))
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        if self._asserts_on_time(node.test):
            self.found.timed_asserts.append((node.lineno, self._where()))
        self.generic_visit(node)

    def _asserts_on_time(self, test: ast.AST) -> bool:
        if self._reads_clock(test):
            return True
        if any(isinstance(n, ast.Name) and n.id in self._clocked for n in ast.walk(test)):
            return True
        for compare in ast.walk(test):  # `elapsed < 2`, `result["seconds"] < 1.0`
            if isinstance(compare, ast.Compare) and any(
                isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in compare.ops
            ):
                for n in ast.walk(compare):
                    if (isinstance(n, ast.Name) and n.id in DURATION_NAMES) or (
                        isinstance(n, ast.Constant) and n.value in DURATION_NAMES
                    ):
                        return True
        return False


def scan(source: str) -> Findings:
    tree = ast.parse(source)
    scanner = _Scan(tree)
    scanner.visit(tree)
    return scanner.found


def _modules() -> Iterator[tuple[str, str]]:
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel not in EXEMPT:
            yield rel, path.read_text()


@pytest.fixture(scope="module")
def findings() -> dict[str, tuple[Findings, list[str]]]:
    return {rel: (scan(text), text.splitlines()) for rel, text in _modules()}


def test_no_test_asserts_on_elapsed_time(findings: dict[str, tuple[Findings, list[str]]]) -> None:
    """Assert on what happened (a bounded wait returned because its condition held, an
    injected clock moved past a TTL), never on how long it took."""
    bad = [
        f"{rel}:{line} {where}"
        for rel, (f, _) in findings.items()
        for line, where in f.timed_asserts
    ]
    assert bad == []


def test_no_test_polls_by_a_loop_of_its_own(
    findings: dict[str, tuple[Findings, list[str]]],
) -> None:
    bad = [
        f"{rel}:{line} {where}: use tests.timing.wait_until"
        for rel, (f, _) in findings.items()
        for line, where in f.polling_loops
        if (rel, where) not in REAL_DURATIONS and (rel, where) not in NOT_YET_MOVED
    ]
    assert bad == []


def test_a_test_sleeps_only_where_a_real_duration_is_tested_and_says_so(
    findings: dict[str, tuple[Findings, list[str]]],
) -> None:
    unlisted, silent = [], []
    for rel, (f, lines) in findings.items():
        for line, where in f.sleeps:
            if (rel, where) in NOT_YET_MOVED:
                continue
            if (rel, where) not in REAL_DURATIONS:
                unlisted.append(f"{rel}:{line} {where}")
            elif "#" not in lines[line - 1]:
                silent.append(f"{rel}:{line} {where}")
    assert unlisted == [], "wait for the event (tests.timing), or list a real duration"
    assert silent == [], "a sleep left says on its line why its duration is the point"


def test_every_listed_real_duration_is_still_there(
    findings: dict[str, tuple[Findings, list[str]]],
) -> None:
    used = {
        (rel, where)
        for rel, (f, _) in findings.items()
        for _line, where in [*f.sleeps, *f.polling_loops]
    }
    assert sorted((set(REAL_DURATIONS) | NOT_YET_MOVED) - used) == []


def test_the_scan_finds_what_the_rules_forbid() -> None:
    found = scan(
        "import asyncio, time\n"
        "from time import monotonic\n"
        "def f():\n"
        "    started = time.monotonic()\n"
        "    assert time.monotonic() - started < 2.5\n"
        "    elapsed = monotonic() - started\n"
        "    assert 0.9 <= elapsed\n"
        "    assert result['seconds'] < 1.0\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not ready():\n"
        "        assert time.monotonic() < deadline\n"
        "async def g():\n"
        "    while not ready():\n"
        "        await asyncio.sleep(0.2)\n"
        "    await asyncio.sleep(0)\n"
        "    time.sleep(6.0)\n"
    )
    assert [line for line, _ in found.timed_asserts] == [5, 7, 8, 11]
    assert found.polling_loops == [(10, "f"), (13, "g")]
    assert found.sleeps == [(14, "g"), (16, "g")]
    assert scan("import time\ndef f():\n    assert result['seconds'] == 3\n") == Findings()
