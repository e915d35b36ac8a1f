"""The run's timeline, ``RUN_DIR/trace.json``: rollouts, engine calls, environment steps, weight
updates, gate pauses and train phases as spans with their start and end, in Chrome's trace event
format (Perfetto and chrome://tracing open it).

What a span lands on:
  process ("pid")   a role: the rollout role, trainer rank r, environment worker k, rollout process k
  lane ("tid")      inside a role: one per trajectory (``sample G/I``, where its ``generate`` engine
                    calls, ``env.step`` and ``reward`` nest inside its ``sample`` span), ``steps`` (the
                    step's phases), ``eval`` (evaluations), ``weights`` (updates), ``update gate`` (pauses), ``train``
Within a lane, spans nest or are disjoint (a trajectory's calls are sequential).

Each process collects its spans in its ``Timeline`` (no global: the rollout context, the client and
the train loop hold theirs); the rollout role gathers them (trainer ranks through the step's
collective, rollout processes with their groups) and appends them to ``trace.json`` after every step.
The file is a JSON array written as a stream: a run still going (or killed) leaves it without its
closing ``]``, which both viewers accept; a finished run closes it, and a resumed run continues it.
Times are wall-clock microseconds, comparable across the processes of a machine (across nodes, as far
as their clocks agree). ``--trace steps`` keeps only the step-level lanes (no per-trajectory spans):
at 10,000 trajectories a step the per-trajectory spans are about 15 MB a step.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TRACE_FILE = "trace.json"
TRAJECTORY_CATEGORIES = ("sample", "engine", "env", "reward")  # what ``--trace steps`` leaves out

# the lane of the trajectory the running task works for (set per sample by the group rollout; asyncio
# tasks and the env thread pool's calls inherit it), so that engine calls and env steps deep inside a
# user's generate function land on their trajectory's lane
current_lane: contextvars.ContextVar[str | None] = contextvars.ContextVar("slime_mt_lane", default=None)


@contextlib.contextmanager
def default_lane(lane: str | None) -> Iterator[None]:
    """Inside the block, spans without a trajectory's lane go to ``lane`` (a gateway session's calls)."""
    if lane is None or current_lane.get() is not None:
        yield
        return
    token = current_lane.set(lane)
    try:
        yield
    finally:
        current_lane.reset(token)


def now_us() -> int:
    return time.time_ns() // 1000


def sample_lane(sample) -> str:
    return f"sample {sample.group_index}/{sample.index}"


class Timeline:
    """One process's spans: ``span`` (a context manager) or ``add`` (known start and end) append a
    Chrome ``X`` event; ``drain`` hands them over. Thread-safe."""

    def __init__(self, process: str, trajectories: bool = True) -> None:
        self.process = process
        self.trajectories = trajectories  # False under --trace steps
        self._events: list[dict] = []
        self._lock = threading.Lock()

    def add(
        self, name: str, start_us: int, end_us: int, lane: str, category: str, process: str | None = None, **args: Any
    ) -> None:
        if not self.trajectories and category in TRAJECTORY_CATEGORIES:
            return
        event = {
            "name": name,
            "cat": category,
            "ph": "X",
            "ts": start_us,
            "dur": max(end_us - start_us, 0),
            "pid": process or self.process,
            "tid": lane,
        }
        if args:
            event["args"] = args
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def span(
        self, name: str, category: str, lane: str | None = None, process: str | None = None, **args: Any
    ) -> Iterator[dict]:
        """A span around the block on ``lane`` (default: the current trajectory's, else the category);
        the yielded dict takes arguments known only at the end."""
        lane = lane or current_lane.get() or category
        start = now_us()
        extra: dict = {}
        try:
            yield extra
        finally:
            self.add(name, start, now_us(), lane, category, process, **args, **extra)

    def extend(self, events: list[dict]) -> None:
        """Spans another process recorded (already in the trace's form)."""
        with self._lock:
            self._events.extend(events)

    def drain(self) -> list[dict]:
        with self._lock:
            events, self._events = self._events, []
        return events


def maybe_span(timeline: Timeline | None, name: str, category: str, **kw: Any):
    """``timeline.span(...)``, or nothing without a timeline."""
    return timeline.span(name, category, **kw) if timeline is not None else contextlib.nullcontext({})


class TraceWriter:
    """``RUN_DIR/trace.json`` as a streamed JSON array: ``write`` appends events (lanes and processes
    named by metadata events the first time they appear, numbered as Chrome's format wants),
    ``close`` ends the array."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / TRACE_FILE
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[str, str], int] = {}
        self._first = True
        if self.path.is_file():  # a resumed run continues its trace
            self._reopen()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("[\n")

    def _reopen(self) -> None:
        text = self.path.read_text().rstrip()
        if text.endswith("]"):
            text = text[:-1].rstrip()
        events = json.loads(text.rstrip(",") + "]") if text not in ("", "[") else []
        for event in events:  # the numbering the file already uses
            if event.get("ph") == "M" and event["name"] == "process_name":
                self._pids[event["args"]["name"]] = event["pid"]
            elif event.get("ph") == "M" and event["name"] == "thread_name":
                self._tids[(event["args"]["process"], event["args"]["name"])] = event["tid"]
        self._first = not events
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, self.path)

    def _numbered(self, event: dict, out: list[dict]) -> dict:
        process, lane = str(event["pid"]), str(event["tid"])
        if process not in self._pids:
            self._pids[process] = len(self._pids) + 1
            out.append({"name": "process_name", "ph": "M", "pid": self._pids[process], "args": {"name": process}})
        pid = self._pids[process]
        if (process, lane) not in self._tids:
            self._tids[(process, lane)] = len(self._tids) + 1
            tid = self._tids[(process, lane)]
            names = {"name": lane, "process": process}
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": names})
        return {**event, "pid": pid, "tid": self._tids[(process, lane)]}

    def write(self, events: list[dict]) -> None:
        out: list[dict] = []
        for event in sorted(events, key=lambda e: e["ts"]):
            numbered = self._numbered(event, out)
            out.append(numbered)
        if not out:
            return
        text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in out)
        with open(self.path, "a") as f:
            f.write(("" if self._first else ",\n") + text)
        self._first = False

    def close(self) -> None:
        with open(self.path, "a") as f:
            f.write("\n]\n")


def load_trace(path: Path) -> list[dict]:
    """The events of a trace file, closed or still streaming (no closing ``]``)."""
    text = Path(path).read_text().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)
