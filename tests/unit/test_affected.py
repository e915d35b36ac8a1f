"""``scripts/test.sh --affected`` (issue 68 item 5): scripts/affected.py selects the test files whose imports,
plug-in and script names, started commands and conftest fixtures reach a changed file. On three sample changes:
the README alone runs the unit tier only; the Megatron actor and a rollout module select the tests that reach
them (the Megatron worlds and train runs; the rollout's tests) and leave out those that do not; a change it
cannot place runs everything. Unit tier: the project's files parsed once, nothing imported (a few seconds)."""

import importlib.util
import sys

import pytest
from train_helpers import REPO


@pytest.fixture(scope="module")
def affected():
    spec = importlib.util.spec_from_file_location("affected", REPO / "scripts/affected.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module, module.graph()


def test_the_readme_alone_runs_the_unit_tier_and_what_it_cannot_tell_runs_everything(affected):
    script, edges = affected
    assert script.select(["README.md"], edges=edges) == "unit"
    # the docs site's sources (its pages, its config, an example's README: a page of it) run its test too
    site = ["tests/unit", "tests/integration/docs/test_docs_site.py"]
    assert script.select(["README.md", "examples/scripting/README.md"], edges=edges) == site
    assert script.select(["docs/engines.md", "docs/inspect_viewer.png", "mkdocs.yml"], edges=edges) == site
    staleness_and_site = script.select(["slime_mt/rollout/staleness.py", "docs/async.md"], edges=edges)
    assert site[1] in staleness_and_site and "tests/unit" not in staleness_and_site
    for change in ("setup.py", "pyproject.toml", "scripts/_venv.sh", "tests/conftest.py", "tests/helpers/tiers.py"):
        assert script.select([change], edges=edges) == "all", change
    assert script.select(["somewhere/else.bin"], edges=edges) == "all"
    assert script.select([], edges=edges) == []


def test_the_megatron_actor_selects_the_worlds_and_the_runs_not_the_gateway_parsers(affected):
    script, edges = affected
    chosen = script.select(["slime_mt/backends/megatron/actor.py"], edges=edges)
    assert {
        "tests/integration/backends/test_roles.py",  # a Megatron world (megatron_worker.py, by name)
        "tests/e2e/test_slime_geo3k.py",  # a slime-mt train run
        "tests/unit/test_driver.py",
    } <= set(chosen)
    assert "tests/unit/gateway/test_parsers.py" not in chosen and "tests/unit/algo/test_losses.py" not in chosen
    assert 50 < len(chosen) < 100  # of 139 test files


def test_a_rollout_module_selects_its_tests(affected):
    script, edges = affected
    chosen = script.select(["slime_mt/rollout/staleness.py"], edges=edges)
    assert {"tests/integration/rollout/test_rollout_manager.py", "tests/e2e/test_train.py"} <= set(chosen)
    assert "tests/unit/gateway/test_parsers.py" not in chosen
    both = script.select(["slime_mt/rollout/staleness.py", "README.md"], edges=edges)
    assert both == chosen  # Markdown beside code adds nothing: the code's tests run
    data_file = script.select(["slime_mt/inspection/viewer.html"], edges=edges)  # a module folder's file
    assert "tests/integration/inspection/test_viewer.py" in data_file
