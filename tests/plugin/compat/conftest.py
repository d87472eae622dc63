"""Isolation for the upstream-compatibility tests: a clean TE_FL_* environment and a reloaded default manager."""

import sys
from pathlib import Path

import pytest

from transformer_engine.plugin.core import envvars, reset_default_manager, reset_global_policy

HERE = Path(__file__).parent
_ENV_VARS = ("TE_FL_PREFER", "TE_FL_PREFER_VENDOR", "TE_FL_SKIP_CUDA", "TE_FL_STRICT", "TE_FL_ALLOW_VENDORS",
             "TE_FL_DENY_VENDORS", "TE_FL_PER_OP", "TE_FL_PLUGIN_MODULES", "TE_FL_LOG_LEVEL", "TEFL_LOG_LEVEL")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Each test starts from no TE_FL_* variable; the default manager and policy are reloaded after it."""
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(HERE))
    reset_global_policy()
    envvars.reset_warnings()
    yield
    monkeypatch.undo()
    sys.modules.pop("_upstream_style_plugin", None)
    reset_global_policy()
    envvars.reset_warnings()
    reset_default_manager()
