"""The sandbox tests' two modes."""

import pytest
from sandbox_helpers import ISOLATED, NO_USERNS

import envs.sandbox as sandbox


@pytest.fixture(params=["isolated", "limits-only"])
def mode(request, monkeypatch):
    """Each test in both modes: namespaces where this machine allows them, and the fallback."""
    if request.param == "isolated" and not ISOLATED:
        pytest.skip(NO_USERNS)
    monkeypatch.setattr(sandbox, "sandbox_mode", lambda: request.param)
    return request.param
