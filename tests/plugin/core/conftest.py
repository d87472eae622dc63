"""Isolation for the dispatch-core tests: no TE_FL_* variable leaks in, no policy or op leaks out; ``site``, a
temporary import directory for plugin modules."""

import sys

import pytest

from transformer_engine.plugin.core import catalog, devices, envvars, register_capability_probe, reset_global_policy

_ENV_VARS = (
    "TE_FL_PREFER",
    "TE_FL_STRICT",
    "TE_FL_ALLOW_VENDORS",
    "TE_FL_DENY_VENDORS",
    "TE_FL_PER_OP",
    "TE_FL_PLUGIN_MODULES",
    "TE_FL_LOG_LEVEL",
    "TEFL_LOG_LEVEL",
)


@pytest.fixture(autouse=True)
def _clean_policy(monkeypatch):
    """Each test starts from an empty TE_FL_* environment and re-reads it; the global policy is reset after.

    The once-per-process configuration warnings are forgotten too, so each test sees its own.
    """
    for name in _ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    reset_global_policy()
    envvars.reset_warnings()
    yield
    reset_global_policy()
    envvars.reset_warnings()


@pytest.fixture
def restore_catalog():
    """Ops a test declares are removed from the process-wide catalog afterwards."""
    catalog.list_specs()  # the built-in ops are declared before the snapshot
    saved = dict(catalog._SPECS)
    yield
    with catalog._LOCK:
        catalog._SPECS.clear()
        catalog._SPECS.update(saved)


@pytest.fixture
def fake_gpu_probe():
    """Device type ``tefltestgpu``: index 0 has compute capability 9.0, index 1 has 8.0."""
    register_capability_probe("tefltestgpu", lambda index: {0: (9, 0), 1: (8, 0)}.get(index))
    yield "tefltestgpu"
    with devices._lock:
        devices._probes.pop("tefltestgpu", None)
        devices._probe_cache.clear()


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A temporary directory on sys.path; ``tefl_test_*`` modules imported from it are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("tefl_test_"):
            del sys.modules[name]
