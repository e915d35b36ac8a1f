"""The import graph's rules (scripts/import_graph.py): no circle of modules or of rooms, the config package
above nothing but the errors, slime_mt free of envs and rollouts, the engines free of the trainer, every
import inside a function there for a reason. Unit tier, about 0.5 s (the project's files parsed, nothing
imported)."""

import importlib.util
import sys

from train_helpers import REPO


def _script():
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts/import_graph.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_import_graph_keeps_its_rules():
    report = _script().analyse()
    assert report.broken == [], "\n".join(report.broken)
    assert report.module_circles == [] and report.room_circles == []
    assert report.floors["errors.py"] == 1 and report.floors["slime_mt/config"] == 2
    assert all(why for _, why in report.nested)


def test_a_loop_and_an_idle_import_inside_a_function_are_caught(tmp_path):
    """The rules fail on a tree that breaks them: a circle through an import inside a function, the config
    package importing the project, an engine importing the trainer, and an import inside a function that defers
    nothing."""
    graph = _script()
    package = tmp_path / "slime_mt"
    package.mkdir()
    (tmp_path / "envs").mkdir()
    (tmp_path / "rollouts").mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("from slime_mt.types import Sample\n")
    (package / "types.py").write_text("def f():\n    from slime_mt.config import X\n")
    (package / "data.py").write_text("def g():\n    from slime_mt.types import Sample\n")
    (package / "engine").mkdir()
    (package / "backends").mkdir()
    (package / "backends" / "convert.py").write_text("X = 1\n")
    (package / "engine" / "sync.py").write_text("from slime_mt.backends.convert import X\n")
    report = graph.analyse(tmp_path)
    assert report.module_circles == [["slime_mt.config", "slime_mt.types"]]
    assert any("the config package imports nothing of the project but its errors" in line for line in report.broken)
    assert any(
        "slime_mt.data:2 imports slime_mt.types inside a function for no reason" in line for line in report.broken
    )
    assert any(
        "slime_mt.engine.sync:1 imports slime_mt.backends.convert: the engines import nothing of the trainer" in line
        for line in report.broken
    )
    assert [why.split(":")[0] for _, why in report.nested] == ["", "dodges a loop"]
