"""The suite's pre-imported process (tests/helpers/forkserver.py, issue 68 item 2): a `python -m` run
forked from it is the command it stands for: its arguments, folder, environment, ``sys.path``, streams,
pid and exit code; a timeout kills it; a setting a preloaded package reads at import starts a plain
process instead, and where the pytest process itself set one for good, a second server. Integration tier:
the server of this pytest process (started here if no run started it before, about 8 s), a second one
(about 8 s) and nine short runs."""

import json
import os
import signal
import subprocess
import sys
import tempfile

import forkserver
import pytest
import tiers

PROBE = """
import json, os, sys, time
if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "show":
        torch = "torch" in sys.modules
        import numpy
        seen = {"pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv[1:], "x": os.environ.get("PROBE_X")}
        seen |= {"torch": torch, "path": sys.path[:2], "stdin": sys.stdin.read(), "np": numpy.random.random()}
        print(json.dumps(seen))
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if mode == "raise":
        raise ValueError("boom")
    if mode == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
"""


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """``python -m forkserver_probe MODE``, routed to the server, with its folder on PYTHONPATH."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "forkserver_probe.py").write_text(PROBE)
    monkeypatch.setattr(forkserver, "ROUTED", forkserver.ROUTED | {"forkserver_probe"})
    monkeypatch.setattr(subprocess, "Popen", forkserver.Popen)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "code"), PROBE_X="42")
    return [sys.executable, "-m", "forkserver_probe"], env


def test_a_forked_run_is_the_command_it_stands_for(probe, tmp_path):
    cmd, env = probe
    assert forkserver._server().refuses(env) is None, forkserver._server().refuses(env)
    cpu, forked = tiers.FORKED_CPU[0], tiers.FORKED[0]
    proc = subprocess.run([*cmd, "show", "a b"], input="in", capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 3 and proc.stderr == "to stderr\n", proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["torch"]  # it came from the server, which imported torch
    assert (seen["cwd"], seen["argv"], seen["x"], seen["stdin"]) == (str(tmp_path), ["show", "a b"], "42", "in")
    assert seen["path"] == [str(tmp_path), str(tmp_path / "code")]  # as `python -m` puts them
    assert seen["pid"] != os.getpid() and tiers.FORKED_CPU[0] > cpu  # its CPU time counts as a child's
    assert tiers.FORKED[0] == forked + 1  # counted for the budget's summary
    again = json.loads(subprocess.run([*cmd, "show"], capture_output=True, text=True, env=env).stdout)
    assert again["pid"] != seen["pid"] and again["np"] != seen["np"]  # numpy's global state drawn anew
    failed = subprocess.run([*cmd, "raise"], capture_output=True, text=True, env=env)
    assert failed.returncode == 1 and failed.stderr.rstrip().endswith("ValueError: boom")


def test_signals_reach_the_run_and_a_timeout_kills_it(probe):
    cmd, env = probe
    child = subprocess.Popen([*cmd, "sleep"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline() == "sleeping\n" and child.poll() is None
    assert os.path.exists(f"/proc/{child.pid}")  # the run's own pid
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=30) == -signal.SIGINT  # KeyboardInterrupt uncaught, as python -m exits
    assert "KeyboardInterrupt" in child.stderr.read()
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([*cmd, "sleep"], capture_output=True, env=env, timeout=2)


def test_a_setting_read_at_import_starts_a_plain_process(probe, monkeypatch):
    cmd, env = probe
    monkeypatch.setenv("PYTHONBREAKPOINT", "ray.util.rpdb.set_trace")  # as ray.init() sets it: read when used
    forked = subprocess.run([*cmd, "show"], capture_output=True, text=True, env=dict(os.environ, **env))
    assert forked.returncode == 3 and json.loads(forked.stdout)["torch"]
    plain = subprocess.run([*cmd, "show"], capture_output=True, text=True, env=dict(env, OMP_NUM_THREADS="7"))
    assert plain.returncode == 3 and not json.loads(plain.stdout)["torch"]
    assert "sets OMP_NUM_THREADS otherwise than the server's" in tiers.PLAIN[-1]  # said in the budget's summary
    elsewhere = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True)
    assert elsewhere.stdout == b"False\n"  # not a routed module: a plain process


def test_this_process_set_for_good_starts_a_server_as_it_is_now(probe, monkeypatch, tmp_path):
    """Here the temp folder, set for good, and long: a socket's file path may not pass 107 bytes, which
    a CI machine's TMPDIR can (the server's socket is abstract, so it starts there too)."""
    cmd, env = probe
    first = forkserver._server()
    # room for one more server, however many this worker's runs have started (at most MAX_SERVERS)
    monkeypatch.setattr(forkserver, "MAX_SERVERS", len(forkserver.SERVERS) + 1)
    long = tmp_path / ("t" * 110)
    long.mkdir()
    try:
        with monkeypatch.context() as patch:
            patch.setenv("TMPDIR", str(long))  # as a library may set a variable read at import, for good
            patch.setattr(tempfile, "tempdir", str(long))
            seen = json.loads(subprocess.run([*cmd, "show"], capture_output=True, env=dict(os.environ, **env)).stdout)
            assert forkserver.SERVERS[-1] is not first and forkserver.SERVERS[-1].env["TMPDIR"] == str(long)
            assert len(str(forkserver.SERVERS[-1].folder / "socket")) > 107
            assert seen["torch"], forkserver.SERVERS[-1].refuses(None)
        assert forkserver._server() is first  # as it was: the first server again
    finally:
        if forkserver.SERVERS[-1] is not first:  # the later runs of this process keep one server
            forkserver.SERVERS.pop().close()
