"""The test tiers and the time budget (a pytest plugin, loaded by tests/conftest.py).

Tiers by folder: ``tests/unit``, ``tests/integration``, ``tests/e2e``. Each test gets its folder's
marker at collection (``-m unit`` selects a tier) and the tiers run in that order, so a fast failure
comes first. A unit test that starts a subprocess or a process, listens or connects on a network
socket, or starts a torch.distributed group or Ray fails, naming the call: such a test belongs in
``tests/integration`` (one real part) or ``tests/e2e`` (train runs, torchrun worlds, Ray clusters).

The budget, set in pyproject.toml (``[tool.pytest.ini_options]``): a test whose set-up, call and
teardown together take longer than ``budget_test_seconds`` times ``budget_noise``, or a unit tier longer
than ``budget_unit_seconds`` (its tests' time; from start to end, collection included, when only unit
tests run), fails the session after the summary, which prints each tier's test count and time. A test
past its budget but within the noise (the same tests, on another machine of the kind, take up to that
factor longer) is listed as over the budget, a debt, without failing the session.

The budget gates CI: under ``CI=true`` (``.ci/run`` sets it) a violation fails the session; elsewhere (a
developer's machine, maybe busy with other work) the same lines print as a warning and the exit code is
the tests' own. The summary prints, per tier, the tests, their seconds and their CPU seconds (each test's
process and the processes it waited for), and how loaded the machine was: the load average and the CPU
time of everything outside the suite's processes. ``--tier-profile PATH`` (``scripts/test.sh --profile``)
writes one line per test: wall seconds, CPU seconds, processes it started itself. A test skipped because a
tool is missing (``skip_missing``: Chromium, user namespaces) fails under ``CI=true``, naming the tool.

What the budget counts is the time the machine gave: a virtual machine's host may run other guests on its
cores (``steal`` in ``/proc/stat``: the time a virtual CPU was ready to run and not run). The seconds
stolen while a test or a shared set-up ran, averaged over the CPUs, are not counted against it; the
summary prints them beside the time taken, and the share of the run the host took.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import socket
import subprocess
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e")
TIER = pytest.StashKey[str]()  # an item's tier
PROC_STAT = Path("/proc/stat")  # the kernel's CPU time counters (Linux); elsewhere nothing is stolen


def stolen_seconds() -> float:
    """Seconds the host took from this machine so far (``steal`` in ``PROC_STAT``, in clock ticks),
    averaged over its CPUs: the wall time one CPU of it was not given; 0.0 where there is no such file."""
    try:
        lines = PROC_STAT.read_text().splitlines()
    except OSError:
        return 0.0
    total = next((line.split() for line in lines if line.startswith("cpu ")), None)
    if total is None or len(total) < 9:
        return 0.0
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit()) or 1
    return int(total[8]) / os.sysconf("SC_CLK_TCK") / cpus


def under_ci() -> bool:
    """Whether this is a CI run (``CI=true``, as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


FORKED_CPU = [0.0]  # CPU seconds of the runs forked for this process that have ended (forkserver.py)
FORKED = [0]  # the slime-mt runs forked for this process (forkserver.py)
PLAIN: list[str] = []  # why each slime-mt run the fork server could not take started as a plain process


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (user and system), the runs the
    fork server started for it counted as children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + FORKED_CPU[0]


def busy_seconds() -> float:
    """CPU time every process of the machine has had so far (``PROC_STAT``'s busy columns, all CPUs; 0.0
    where there is no such file)."""
    try:
        fields = PROC_STAT.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return 0.0
    if fields[:1] != ["cpu"] or len(fields) < 8:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


MISSING = "missing on this machine: "  # a skip reason that begins so is a tool missing: a failure under CI


def skip_missing(what: str):
    """Skip a test because ``what`` (a tool: Chromium, user namespaces) is missing here; under ``CI=true``
    the test fails instead, naming it (a CI machine that lacks it would drop its tests without a word)."""
    pytest.skip(MISSING + what)


STARTED = [0]  # processes this process started (subprocess.Popen, multiprocessing), counted for the profile


def _count_starts() -> None:
    import multiprocessing.process

    for owner, name in ((subprocess.Popen, "__init__"), (multiprocessing.process.BaseProcess, "start")):
        owner = next(c for c in owner.__mro__ if name in c.__dict__)  # forkserver.Popen: the one it extends
        original = owner.__dict__[name]

        def counted(self, *args, __original=original, **kwargs):
            STARTED[0] += 1
            return __original(self, *args, **kwargs)

        setattr(owner, name, counted)


def tier_of(path: Path) -> str:
    """The tier of a test file: the first folder under tests/."""
    try:
        folder = Path(path).resolve().relative_to(TESTS).parts[0]
    except ValueError:
        folder = ""
    if folder not in TIERS:
        raise pytest.UsageError(f"{path}: a test lives in tests/unit, tests/integration or tests/e2e")
    return folder


class UnitTierError(RuntimeError):
    """A unit test reached for something only integration and end-to-end tests may start."""


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UnitTierError(
            f"a unit test may not {what}: move the test to tests/integration (one real part: an engine, a "
            f"server, a Megatron world, a sandbox, a browser) or tests/e2e (train runs, torchrun, Ray)"
        )

    return refused


def _network(family) -> bool:
    return family in (socket.AF_INET, socket.AF_INET6)


def _guarded_socket_method(name: str, original):
    refuse = _refuse(f"{name} on a network socket")

    def method(self, *args, **kwargs):
        if _network(self.family):
            refuse()
        return original(self, *args, **kwargs)

    return method


@functools.cache
def _library_set_up() -> None:
    """What a library the unit tests use does once per machine, done before the guard: matplotlib lists
    the system's fonts with ``fc-list`` (a subprocess) when it finds no font cache (a fresh machine or
    home), then caches them."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


def _unit_guard() -> ExitStack:
    """Patches that make a unit test fail when it starts what it may not; undone by closing the stack."""
    import multiprocessing.process

    _library_set_up()

    import torch.distributed

    stack = ExitStack()
    patches = [
        (subprocess.Popen, "__init__", _refuse("start a subprocess")),
        (multiprocessing.process.BaseProcess, "start", _refuse("start a process")),
        (socket.socket, "listen", _guarded_socket_method("listen", socket.socket.listen)),
        (socket.socket, "connect", _guarded_socket_method("connect", socket.socket.connect)),
        (socket.socket, "connect_ex", _guarded_socket_method("connect", socket.socket.connect_ex)),
        (torch.distributed, "init_process_group", _refuse("start a torch.distributed group")),
    ]
    try:
        import ray

        patches.append((ray, "init", _refuse("start or join Ray")))
    except ImportError:
        pass
    for owner, name, replacement in patches:
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        setattr(owner, name, replacement)
        stack.callback(setattr, owner, name, original)
    return stack


def pytest_addoption(parser):
    parser.addoption(
        "--tier-profile",
        metavar="PATH",
        default=None,
        help="write each test's wall seconds, CPU seconds and processes started to PATH (tab-separated)",
    )
    parser.addini("budget_test_seconds", "a test's set-up, call and teardown together, at most (s)", default="90")
    parser.addini("budget_unit_seconds", "the unit tier, at most (s)", default="180")
    parser.addini(
        "budget_noise",
        "a test fails the session past its budget times this factor (how much longer the same test takes on "
        "another machine of the kind); between the two it is listed as over the budget",
        default="1",
    )
    parser.addini(
        "budget_exceptions",
        "lines 'NODEID SECONDS': a test allowed more than budget_test_seconds, up to SECONDS (a debt: every "
        "summary prints it)",
        type="linelist",
    )
    parser.addini(
        "worker_groups",
        "lines 'GROUP PREFIX': the tests whose node ids start with a PREFIX of GROUP run as one unit on one "
        "pytest-xdist worker (they read a costly session set-up, made once there, or use a machine-wide "
        "resource that no other worker's test may use meanwhile)",
        type="linelist",
    )


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its share of the cores, for what it starts
        workers = int(config.workerinput["workercount"])
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier (tests/{tier}), added by folder")
    _count_starts()
    config._setup_clock = SetupClock()
    config.pluginmanager.register(config._setup_clock, "tier-setup-clock")
    if not hasattr(config, "workerinput"):  # the process that reports (not a pytest-xdist worker)
        config.pluginmanager.register(Budget(config), "tier-budget")


def pytest_collection_modifyitems(config, items):
    """Each test gets its tier's marker; the tiers run in order (a stable sort keeps modules whole)."""
    for item in items:
        tier = tier_of(item.path)
        item.add_marker(tier)
        item.stash[TIER] = tier
    # one process: the fast tiers first; pytest-xdist workers: the slow tiers first, so that what runs last
    # on each worker is short (the worker_groups go before them all)
    order = TIERS[::-1] if hasattr(config, "workerinput") else TIERS
    items.sort(key=lambda item: order.index(item.stash[TIER]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    clock = item.config._setup_clock
    clock.current = item.nodeid
    clock.start_phase()
    try:
        if item.stash.get(TIER, None) != "unit":
            return (yield)
        with _unit_guard():
            return (yield)
    finally:
        clock.current = None


class SetupClock:
    """Where tests run: times each shared (module or session) fixture's set-up and puts what a test's
    phase set up on that phase's report (``user_properties``), which pytest-xdist carries to the
    process that reports. Times are counted net of what the host stole (``stolen_seconds``)."""

    def __init__(self):
        self.current: str | None = None  # the test running now
        self.nested: list[float] = []  # per shared set-up in progress: the counted time of those inside it
        self.shared = 0.0  # this phase's shared set-ups, outermost only, counted
        self.fixtures: dict[str, float] = {}  # this phase's: "fixture NAME (scope, where)" -> own counted time
        self.phase_stolen = stolen_seconds()  # the counter when this phase began
        self.start_phase()

    def start_phase(self) -> None:
        self.phase_stolen = stolen_seconds()
        self.phase_cpu, self.phase_started, self.phase_forked = cpu_seconds(), STARTED[0], FORKED_CPU[0]
        self.phase_forks = (FORKED[0], len(PLAIN))

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        if fixturedef.scope == "function":
            return (yield)
        with self.shared_set_up(f"fixture {fixturedef.argname} ({fixturedef.scope}, {fixturedef.baseid or 'tests'})"):
            return (yield)

    @contextlib.contextmanager
    def shared_set_up(self, name: str):
        """Time a set-up that several tests share as ``name``: a module or session fixture, or what a
        session fixture makes when a test first asks for it (a Megatron world): counted as its own, not
        as the test's that happened to ask first."""
        self.nested.append(0.0)
        started, stolen = time.perf_counter(), stolen_seconds()
        try:
            yield
        finally:
            counted = time.perf_counter() - started - (stolen_seconds() - stolen)
            inner = self.nested.pop()
            self.fixtures[name] = max(self.fixtures.get(name, 0.0), counted - inner)
            if self.nested:
                self.nested[-1] += counted
            elif self.current is not None:
                self.shared += counted

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if report.skipped and under_ci() and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            if reason.startswith(MISSING):
                report.outcome = "failed"
                report.longrepr = f"CI=true: a test may not skip for a missing tool: {reason}"
        now = stolen_seconds()
        report.user_properties.append(("budget_stolen_seconds", now - self.phase_stolen))
        report.user_properties.append(("budget_shared_seconds", self.shared))
        report.user_properties.extend(("budget_fixture", f) for f in self.fixtures.items())
        cpu = cpu_seconds()
        report.user_properties.append(("budget_cpu_seconds", cpu - self.phase_cpu))
        report.user_properties.append(("budget_processes", STARTED[0] - self.phase_started))
        report.user_properties.append(("budget_forked_cpu_seconds", FORKED_CPU[0] - self.phase_forked))
        forked, plain = self.phase_forks
        report.user_properties.append(("budget_forks", (FORKED[0] - forked, PLAIN[plain:])))
        self.shared, self.fixtures, self.phase_stolen = 0.0, {}, now
        self.phase_cpu, self.phase_started, self.phase_forked = cpu, STARTED[0], FORKED_CPU[0]
        self.phase_forks = (FORKED[0], len(PLAIN))
        return report


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load-scope scheduling with a work unit per test, and one per group of
    ``worker_groups`` (xdist's own ``--dist loadgroup`` marks do not group under pytest 9). xdist
    hands out the largest units first: the groups, then the tests in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    groups = []
    for line in config.getini("worker_groups"):
        name, *prefixes = line.split()
        groups += [(prefix, name) for prefix in prefixes]

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((f"group {name}" for prefix, name in groups if nodeid.startswith(prefix)), nodeid)

    return SharedSetupScheduling(config, log)


def _tier_of_nodeid(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else ""


NEAREST = 8  # the summary lists this many tests and shared set-ups past half the budget, the longest first


class Budget:
    """Where results are reported: each test's own time (its phases, less the shared set-ups it paid
    for and what the host stole meanwhile), each shared fixture's set-up, the tiers' times; the limits
    from the ini file."""

    def __init__(self, config):
        self.per_test = float(config.getini("budget_test_seconds"))
        self.unit_tier = float(config.getini("budget_unit_seconds"))
        self.noise = float(config.getini("budget_noise"))
        self.exceptions = {}  # node id -> its own limit
        for line in config.getini("budget_exceptions"):
            nodeid, _, seconds = line.rpartition(" ")
            self.exceptions[nodeid] = float(seconds)
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = defaultdict(float)  # test -> its phases' time
        self.shared: dict[str, float] = defaultdict(float)  # test -> shared set-ups it paid for (counted)
        self.stolen: dict[str, float] = defaultdict(float)  # test -> seconds the host stole in its phases
        self.stolen_at_start = stolen_seconds()
        self.fixtures: dict[str, float] = {}  # "fixture NAME (scope, where)" -> its own set-up time
        self.violations: list[str] = []
        self.debts: list[str] = []  # past the budget, within the noise
        self.cpu: dict[str, float] = defaultdict(float)  # test -> CPU seconds of its phases (children waited for)
        self.processes: dict[str, int] = defaultdict(int)  # test -> processes its phases started themselves
        self.busy_at_start, self.cpu_at_start = busy_seconds(), cpu_seconds()
        # the CPU seconds of the runs forked for pytest-xdist workers (forkserver.py): this process waits
        # for the workers, so its children's CPU time holds theirs and their children's, not those runs'
        self.workers_forked_cpu = 0.0
        self.forked, self.plain = 0, Counter()  # slime-mt runs forked; why the others started plain
        self.profile = config.getoption("tier_profile")
        self.gates = under_ci()

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        for key, value in report.user_properties:
            if key == "budget_shared_seconds":
                self.shared[report.nodeid] += value
            elif key == "budget_stolen_seconds":
                self.stolen[report.nodeid] += value
            elif key == "budget_cpu_seconds":
                self.cpu[report.nodeid] += value
            elif key == "budget_forked_cpu_seconds":
                if getattr(report, "node", None) is not None:  # a pytest-xdist worker's, not this process's
                    self.workers_forked_cpu += value
            elif key == "budget_forks":
                self.forked += value[0]
                self.plain.update(value[1])
            elif key == "budget_processes":
                self.processes[report.nodeid] += value
            elif key == "budget_fixture":
                name, seconds = value
                self.fixtures[name] = max(self.fixtures.get(name, 0.0), seconds)

    def limit_of(self, nodeid: str) -> str:
        if nodeid in self.exceptions:
            return f"budget_exceptions: {self.exceptions[nodeid]:g} s"
        return f"budget_test_seconds = {self.per_test:g}"

    def failing_limit_of(self, nodeid: str) -> str:
        if self.noise == 1:
            return self.limit_of(nodeid)
        limit = self.exceptions.get(nodeid, self.per_test) * self.noise
        return f"{self.limit_of(nodeid)}, budget_noise = {self.noise:g}: at most {limit:g} s"

    def own(self, nodeid: str) -> float:
        """A test's counted time: its phases less the shared set-ups (counted) and what was stolen in them
        (the set-ups' steal included, hence added back with their counted time)."""
        return self.seconds[nodeid] - self.shared.get(nodeid, 0.0) - self.stolen.get(nodeid, 0.0)

    def took(self, seconds: float, name: str) -> str:
        stolen = self.stolen.get(name, 0.0)
        return f"{name} took {seconds:.1f} s" + (f" ({stolen:.1f} s more stolen by the host)" if stolen >= 0.05 else "")

    def timed(self) -> list[tuple[float, str]]:
        """(own seconds, name) of every test and every shared set-up, the longest first."""
        tests = [(self.own(n), n) for n in self.seconds]
        return sorted(tests + [(s, n) for n, s in self.fixtures.items()], reverse=True)

    def by_tier(self) -> dict[str, tuple[int, float, float]]:
        """tier -> (tests, their seconds less what was stolen, their CPU seconds)."""
        out = {}
        for tier in TIERS:
            names = [n for n in self.seconds if _tier_of_nodeid(n) == tier]
            if names:
                seconds = sum(self.seconds[n] - self.stolen.get(n, 0.0) for n in names)
                out[tier] = (len(names), seconds, sum(self.cpu.get(n, 0.0) for n in names))
        return out

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session, exitstatus):
        over = [(s, n) for s, n in self.timed() if s > self.exceptions.get(n, self.per_test)]
        failing = [(s, n) for s, n in over if s > self.exceptions.get(n, self.per_test) * self.noise]
        self.violations = [f"{self.took(s, n)} ({self.failing_limit_of(n)})" for s, n in failing]
        self.debts = [f"{self.took(s, n)} ({self.limit_of(n)})" for s, n in over if (s, n) not in failing]
        tiers = self.by_tier()
        if "unit" in tiers:
            unit = tiers["unit"][1]
            if set(tiers) == {"unit"}:  # alone: collection included
                unit = max(unit, time.perf_counter() - self.started - (stolen_seconds() - self.stolen_at_start))
            if unit > self.unit_tier:
                self.violations.append(f"the unit tier took {unit:.1f} s (budget_unit_seconds = {self.unit_tier:g})")
        if self.violations and self.gates and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if self.profile:
            self.write_profile(Path(self.profile))

    def write_profile(self, path: Path) -> None:
        """One line per test, the longest first: node id, tier, seconds, CPU seconds, processes started.
        The lines of tests this session did not run are kept (scripts/test.sh runs the unit tier in a
        session of its own, then the others, into one table; it removes the table before a run)."""
        header = "test\ttier\tseconds\tcpu_seconds\tprocesses"
        rows = {}
        if path.exists():
            rows = {line.split("\t", 1)[0]: line for line in path.read_text().splitlines()[1:] if line}
        for n in self.seconds:
            rows[n] = f"{n}\t{_tier_of_nodeid(n)}\t{self.seconds[n]:.2f}\t{self.cpu[n]:.2f}\t{self.processes[n]}"
        lines = sorted(rows.values(), key=lambda line: -float(line.split("\t")[2]))
        path.write_text("\n".join([header, *lines]) + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        tiers = self.by_tier()
        if not tiers:
            return
        write = terminalreporter.write_line
        terminalreporter.section("tiers and budget")
        for tier, (count, seconds, cpu) in tiers.items():
            write(f"{tier:<12} {count:4d} tests {seconds:8.1f} s {cpu:8.1f} CPU-s")
        wall = time.perf_counter() - self.started
        suite_cpu = cpu_seconds() - self.cpu_at_start + self.workers_forked_cpu
        count = sum(c for c, _, _ in tiers.values())
        write(f"{'session':<12} {count:4d} tests {wall:8.1f} s {suite_cpu:8.1f} CPU-s (collection included)")
        outside = max(0.0, busy_seconds() - self.busy_at_start - suite_cpu)
        load = " ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
        write(
            f"the machine: load average {load} (1, 5, 15 min) on {os.cpu_count()} CPUs; {outside:.1f} CPU-s "
            "outside the suite's processes (other work, and processes the tests started but did not wait for: Ray's)"
        )
        if self.forked or self.plain:
            why = "; ".join(f"{reason} ({n})" for reason, n in self.plain.most_common(4))
            plain = f", {sum(self.plain.values())} started as plain processes: {why}" if self.plain else ""
            write(f"fork server (tests/helpers/forkserver.py): {self.forked} runs forked{plain}")
        stolen = stolen_seconds() - self.stolen_at_start
        if stolen >= 0.05:  # the tiers' and tests' times above and below are counted without it
            share = f"{stolen:.1f} s of each CPU, {stolen / wall:.0%} of the run"
            write(f"stolen by the host (steal, {PROC_STAT}): {share}")
        write(
            f"budget (pyproject.toml): a test or a shared set-up {self.per_test:g} s, unit tier {self.unit_tier:g} s"
            + (f"; a test fails past {self.noise:g} times its budget (budget_noise)" if self.noise != 1 else "")
        )
        for nodeid, limit in self.exceptions.items():
            if nodeid in self.seconds:
                write(f"allowed up to {limit:g} s (budget_exceptions): {self.took(self.own(nodeid), nodeid)}")
        near = [(s, n) for s, n in self.timed() if n not in self.exceptions and self.per_test / 2 <= s <= self.per_test]
        for seconds, name in near[:NEAREST]:  # what drifts past the budget next
            write(f"nearest the budget: {seconds:6.1f} s {name}")
        for line in self.debts:  # the next to pay: past the budget on this machine, within the noise
            terminalreporter.write_line(f"over the budget, within budget_noise: {line}", yellow=True, bold=True)
        for line in self.violations:
            if self.gates:
                terminalreporter.write_line(f"OVER BUDGET: {line}", red=True, bold=True)
            else:
                terminalreporter.write_line(f"over the budget (a warning: it fails CI=true runs): {line}", yellow=True)
