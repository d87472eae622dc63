"""Shared pytest configuration.

- the ``gpu`` marker skips tests when no CUDA device is present;
- every test seeds torch with ``TE_FL_TEST_SEED + crc32(test id)``: each test draws its own fresh
  inputs, and a failure reproduces from the seed alone;
- on a machine with a GPU, a test without the ``gpu`` marker runs as on a CPU-only machine (as in CI):
  ``torch.cuda.is_available()`` answers False inside it, so modules default to the CPU like its inputs;
- at startup, before any test module or doctest can import Triton, the flagos kernels are imported the
  way this machine runs them (``tests/plugin/backends/flagos/_interpreter.py``: the Triton
  interpreter without a GPU), so that their tier can never be skipped because Triton came too early;
- CI cannot pass silently: a test tier expected to run on this machine (:data:`TIERS`) that had
  tests selected but ran none of them (all skipped) fails the session, naming the skip reasons;
- doctests of the package run with the tests (``--doctest-modules``, testpaths ``tests`` and
  ``transformer_engine``); modules that cannot be imported here are left out for the reason listed
  in :data:`DOCTEST_SKIPS`, printed in the summary;
- JAX allocates GPU memory as it needs it (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), not 75% of the
  card on its first use: PyTorch's tests share the process, and a CUDA-graph capture that runs out of
  cached memory frees blocks, which invalidates the capture.
"""

import importlib.util
import os
import zlib
from collections import Counter
from pathlib import Path

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_HAS_TORCH = importlib.util.find_spec("torch") is not None
_ROOT = Path(__file__).resolve().parent.parent


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(name) is not None for name in names)


def _flagos_reason() -> str:
    """'' when the flagos kernels can run here (imported now, interpreted without a GPU), else why not."""
    if not _HAS_TORCH:
        return "torch is not installed"
    # loaded by path: this runs before pytest has set up the `tests` namespace for imports
    spec = importlib.util.spec_from_file_location("_te_fl_flagos_interpreter", _ROOT / "tests/plugin/backends/flagos/_interpreter.py")
    interpreter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(interpreter)
    return interpreter.import_kernels()


_FLAGOS_REASON = _flagos_reason()

#: Test tiers that must run whenever their dependencies are here: name -> (directory under the
#: repository, True when the tier is expected to run on this machine). A tier with tests selected
#: but none run fails the session (a tier whose dependency is missing may skip, and says so).
TIERS = {
    "flagos kernels (tests/plugin/backends/flagos)": ("tests/plugin/backends/flagos", _installed("triton") and _HAS_TORCH),
    "op contracts (tests/plugin/test_op_contracts.py)": ("tests/plugin/test_op_contracts.py", _HAS_TORCH),
    "reference backend (tests/plugin/backends/reference)": ("tests/plugin/backends/reference", _HAS_TORCH),
    "pytorch (tests/pytorch)": ("tests/pytorch", _HAS_TORCH),
    "jax (tests/jax)": ("tests/jax", _installed("jax", "flax")),
    "doctests (transformer_engine)": ("transformer_engine", True),
}

#: Package modules whose doctests cannot run here: path under transformer_engine/ -> reason (or None
#: when they can). A module not listed that fails to import is a collection error, as it should be.
DOCTEST_SKIPS = {
    "plugin/backends/flagos": None if _installed("triton") else "triton is not installed",
    "jax": None if _installed("jax", "flax") else "jax / flax are not installed",
}


def _has_cuda() -> bool:
    if not _HAS_TORCH:
        return False
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """torch.manual_seed(TE_FL_TEST_SEED + crc32(test id)) when torch is installed."""
    if not _HAS_TORCH:
        return
    import torch

    base = int(os.environ.get("TE_FL_TEST_SEED", "0"))
    torch.manual_seed(base + zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _cpu_only_unless_gpu_marked(request, monkeypatch):
    """Hide the GPU from tests without the ``gpu`` marker (see the module docstring)."""
    if "gpu" in request.keywords or not _has_cuda():
        return
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test (compiled graphs keep the tensors they traced alive)."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def recast_weight_transpose(monkeypatch):
    """Modules cast W^T again in backward whatever the weight's size (as for weights above
    ``KEEP_WEIGHT_T_MAX_NUMEL``): the path of large weights, on the small layers of a test."""
    from transformer_engine.pytorch.module import base

    monkeypatch.setattr(base, "KEEP_WEIGHT_T_MAX_NUMEL", 0)


class _TierWatch:
    """Counts, per tier of :data:`TIERS`, the tests selected and the tests run (not skipped); fails the
    session when an expected tier ran none; leaves out the doctests of :data:`DOCTEST_SKIPS`.

    A plugin object rather than conftest hooks, so that its collection hooks also see the package's
    files (a conftest's hooks only apply under its own directory)."""

    def __init__(self):
        self.selected = Counter()
        self.ran = Counter()
        self.reasons = {}
        self.failures = []
        self.doctest_skipped = {}

    @staticmethod
    def _tier(nodeid: str) -> str:
        rel = nodeid.split("::", 1)[0]
        for name, (where, _) in TIERS.items():
            if rel == where or rel.startswith(where + "/"):
                return name
        return ""

    def pytest_ignore_collect(self, collection_path, config):
        rel = collection_path.resolve()
        package = _ROOT / "transformer_engine"
        if not config.getoption("doctestmodules") or not rel.is_relative_to(package):
            return None
        sub = rel.relative_to(package).as_posix()
        for where, reason in DOCTEST_SKIPS.items():
            if reason and (sub == where or sub.startswith(where + "/")):
                self.doctest_skipped[where] = reason
                return True
        return None

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        for item in items:
            tier = self._tier(item.nodeid)
            if tier and not ("gpu" in item.keywords and not _has_cuda()):  # GPU tests may skip on a CPU machine
                self.selected[tier] += 1

    def pytest_runtest_logreport(self, report):
        tier = self._tier(report.nodeid)
        if not tier:
            return
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.reasons.setdefault(tier, Counter())[reason] += 1
        elif report.when == "call" or report.failed:
            self.ran[tier] += 1

    def pytest_sessionfinish(self, session):
        for tier, (_, expected) in TIERS.items():
            if expected and self.selected[tier] and not self.ran[tier]:
                reasons = self.reasons.get(tier, Counter()).most_common(3)
                self.failures.append((tier, self.selected[tier], reasons))
        if self.failures and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter):
        for where, reason in sorted(self.doctest_skipped.items()):
            terminalreporter.write_line(f"doctests of transformer_engine/{where} not collected: {reason}")
        for tier, count, reasons in self.failures:
            terminalreporter.write_line(
                f"FAILED tier {tier}: {count} tests selected, none ran although this machine should run them", red=True
            )
            for reason, n in reasons:
                terminalreporter.write_line(f"    {n} skipped: {reason}", red=True)


def pytest_configure(config):
    config.pluginmanager.register(_TierWatch(), "te_fl_tier_watch")
