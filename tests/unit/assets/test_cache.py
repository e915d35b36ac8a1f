"""The asset cache builds once, atomically, even with concurrent builders."""

import pytest

from slime_mt.assets.cache import cached_dir


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIME_MT_CACHE", str(tmp_path))

    def broken(out):
        (out / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        cached_dir("broken", broken)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    assert cached_dir("broken", lambda out: (out / "ok").write_text("1")).joinpath("ok").read_text() == "1"
