"""The asset cache builds once, atomically, even with concurrent builders."""

import multiprocessing as mp
import os
import time

from slime_mt.assets.cache import cached_dir


def _slow_build(out):
    (out / "part1").write_text("a")
    time.sleep(0.5)
    (out / "part2").write_text(str(os.getpid()))


def _build_in_process(root, queue):
    os.environ["SLIME_MT_CACHE"] = root
    path = cached_dir("thing", _slow_build)
    queue.put((path.name, sorted(p.name for p in path.iterdir()), (path / "part2").read_text()))


def test_two_processes_build_once(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(str(tmp_path), queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert results[0] == results[1]  # the same builder's pid: built exactly once
    assert results[0][1] == ["part1", "part2"]
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".thing.lock")]
    assert leftovers == ["thing"]
