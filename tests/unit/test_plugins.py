import textwrap

import pytest

from slime_mt.errors import PluginError
from slime_mt.plugins import load_function


async def expected_generate(args, sample, sampling_params):
    """The contract a custom generate function must fit."""


def expected_rollout(args, rollout_id, data_source, evaluation=False):
    """The contract a rollout function must fit."""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_plugins.py"
    path.write_text(
        textwrap.dedent("""
        THRESHOLD = 3

        async def generate(args, sample, sampling_params):
            return sample

        def rollout(args, rollout_id, data_source, evaluation=False, extra=None):
            return [[rollout_id]]

        def too_few(args):
            return None

        def sync_generate(args, sample, sampling_params):
            return sample

        class Helper:
            pass
    """)
    )
    return path


def test_dotted_path_loads_a_library_function():
    fn = load_function("slime_mt.plugins.split_spec")
    assert fn("a.b.c") == ("a.b", "c")


def test_file_path_loads_and_runs(user_file):
    fn = load_function(f"{user_file}:rollout", expected=expected_rollout)
    assert fn(None, 7, None) == [[7]]


def test_file_loaded_twice_is_the_same_module(user_file):
    assert load_function(f"{user_file}:rollout") is load_function(f"{user_file}:rollout")


def test_missing_module_names_the_module():
    with pytest.raises(PluginError, match=r"plug-in module 'no_such_pkg.mod' not found"):
        load_function("no_such_pkg.mod.fn")


def test_missing_file_names_the_path_tried(tmp_path):
    with pytest.raises(PluginError, match=r"plug-in file not found: .*nope.py \(tried /.*nope.py\)"):
        load_function(f"{tmp_path}/nope.py:fn")


def test_missing_attribute_lists_callables(user_file):
    with pytest.raises(PluginError) as info:
        load_function(f"{user_file}:generat")
    message = str(info.value)
    assert "has no attribute 'generat'" in message
    assert "generate" in message and "rollout" in message and "Helper" in message
    assert "THRESHOLD" not in message


def test_not_callable(user_file):
    with pytest.raises(PluginError, match=r"'THRESHOLD' is a int, not a callable"):
        load_function(f"{user_file}:THRESHOLD")


def test_signature_mismatch_is_reported(user_file):
    with pytest.raises(PluginError, match=r"signature too_few\(args\) does not fit expected_rollout"):
        load_function(f"{user_file}:too_few", expected=expected_rollout)


def test_sync_function_where_async_expected(user_file):
    with pytest.raises(PluginError, match=r"must be an async function"):
        load_function(f"{user_file}:sync_generate", expected=expected_generate)


def test_async_generate_fits(user_file):
    assert load_function(f"{user_file}:generate", expected=expected_generate).__name__ == "generate"


def test_spec_without_attribute():
    with pytest.raises(PluginError, match="names no attribute"):
        load_function("justamodule")


def test_file_that_raises_on_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(PluginError, match=r"broken.py raised while importing: ModuleNotFoundError"):
        load_function(f"{path}:fn")


def test_a_module_path_is_found_in_the_working_directory(tmp_path, monkeypatch):
    """``--rollout-interaction-env-path calc_env`` from the folder holding calc_env.py: the
    ``slime-mt`` script does not put the working directory on sys.path, the loader looks there."""
    import sys

    (tmp_path / "calc_env_for_cwd_test.py").write_text("def build_env(sample=None, args=None, **kw):\n    return 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_function("calc_env_for_cwd_test.build_env")() == 42
    with pytest.raises(PluginError, match=r"plug-in module 'not_here_either' not found"):
        load_function("not_here_either.fn")
