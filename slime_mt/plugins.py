"""Load user plug-ins (rollout, generate, reward, env, filter functions) from a dotted path or a file.

Two spellings: ``package.module.attr`` (found on ``sys.path``, then in the working directory) and
``path/to/file.py:attr``. Every failure is a PluginError
that says which part failed: the module (with the path tried), the attribute (listing the module's
callables), callability, or the parameters against an expected signature.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType

from slime_mt.errors import PluginError


def load_module(spec: str) -> ModuleType:
    """Import ``package.module`` or a ``path/to/file.py`` (registered under a stable unique name)."""
    if spec.endswith(".py") or os.sep in spec or "/" in spec:
        path = os.path.abspath(os.path.expanduser(spec))
        if not os.path.isfile(path):
            raise PluginError(f"plug-in file not found: {spec} (tried {path})")
        name = (
            "slime_mt_user_"
            + os.path.splitext(os.path.basename(path))[0]
            + "_"
            + hashlib.sha1(path.encode()).hexdigest()[:8]
        )
        if name in sys.modules:
            return sys.modules[name]
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise PluginError(
                f"plug-in file {path} raised while importing: {type(e).__name__}: {e}{_slime_hint(e)}"
            ) from e
        return module
    try:
        return _import_from_cwd_too(spec)
    except ModuleNotFoundError as e:
        if e.name and spec.split(".")[0] != e.name.split(".")[0]:  # the module imports one that is missing
            raise PluginError(
                f"plug-in module '{spec}' raised while importing: {type(e).__name__}: {e}{_slime_hint(e)}"
            ) from e
        tried = ", ".join(sys.path[:4])
        raise PluginError(f"plug-in module '{spec}' not found: {e} (searched sys.path: {tried}, ...)") from e
    except Exception as e:
        raise PluginError(f"plug-in module '{spec}' raised while importing: {type(e).__name__}: {e}") from e


def _slime_hint(error: Exception) -> str:
    """A plug-in written for slime imports ``slime``, which ``--slime-compat`` provides."""
    name = getattr(error, "name", None) or ""
    if isinstance(error, ModuleNotFoundError) and name.split(".")[0] == "slime":
        return " (a plug-in written against slime's API: add --slime-compat)"
    return ""


def _import_from_cwd_too(name: str) -> ModuleType:
    """``import name``; a top-level module not on ``sys.path`` is looked for in the working directory
    too (``python -m`` puts it there, the ``slime-mt`` script does not)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        cwd = os.getcwd()
        if e.name != name.split(".")[0] or cwd in sys.path or "" in sys.path:
            raise
    sys.path.append(cwd)
    return importlib.import_module(name)


def split_spec(spec: str) -> tuple[str, str]:
    """``file.py:fn`` -> (file.py, fn); ``pkg.mod.fn`` -> (pkg.mod, fn)."""
    if not spec or not isinstance(spec, str):
        raise PluginError(f"plug-in path must be 'package.module.attr' or 'file.py:attr', got {spec!r}")
    if ":" in spec:
        module_part, _, attr = spec.rpartition(":")
    elif "." in spec:
        module_part, _, attr = spec.rpartition(".")
    else:
        raise PluginError(f"plug-in path {spec!r} names no attribute: use 'package.module.attr' or 'file.py:attr'")
    if not module_part or not attr:
        raise PluginError(f"plug-in path {spec!r} is incomplete: use 'package.module.attr' or 'file.py:attr'")
    return module_part, attr


def load_function(spec: str, expected: Callable | None = None, what: str = "plug-in") -> Callable:
    """Resolve ``spec`` to a callable; with ``expected`` (a function whose signature is the
    contract), check that the plug-in accepts the same positional parameters."""
    module_part, attr = split_spec(spec)
    try:
        module = load_module(module_part)
    except PluginError as e:
        raise PluginError(f"{what}: {e}" if what != "plug-in" else str(e)) from e.__cause__
    if not hasattr(module, attr):
        callables = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise PluginError(
            f"{what} {spec!r}: module '{module_part}' has no attribute '{attr}'; "
            f"its callables are: {', '.join(callables) or '(none)'}"
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise PluginError(f"{what} {spec!r}: '{attr}' is a {type(fn).__name__}, not a callable")
    if expected is not None:
        check_signature(fn, expected, f"{what} {spec!r}")
    return fn


def check_signature(fn: Callable, expected: Callable, label: str) -> None:
    """The plug-in must accept a call with the expected parameters (by position, and by name for
    those with defaults); extra parameters of the plug-in must have defaults."""
    want = list(inspect.signature(expected).parameters.values())
    try:
        have = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins and C callables expose no signature; nothing to check
    positional = [p for p in want if p.default is inspect.Parameter.empty]
    keywords = {p.name: None for p in want if p.default is not inspect.Parameter.empty}
    try:
        have.bind(*[None] * len(positional), **keywords)
    except TypeError as e:
        expected_text = f"{expected.__name__}{inspect.signature(expected)}"
        raise PluginError(f"{label}: signature {fn.__name__}{have} does not fit {expected_text}: {e}") from None
    if inspect.iscoroutinefunction(expected) and not _is_async(fn):
        raise PluginError(f"{label}: must be an async function (async def), like {expected.__name__}")


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def judge_parser_prototype(text: str) -> float | None:
    """Prototype of ``--judge-parser-path`` (read by ``envs/llm_judge.py``, checked before a run): the
    judge's answer -> its score, or None (unparseable)."""
