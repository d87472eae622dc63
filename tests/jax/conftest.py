"""JAX test configuration: four virtual CPU devices, set before JAX initialises its backend.

The multi-device sharding tests (``test_sharding.py``) need a mesh of 4 devices. XLA reads
``--xla_force_host_platform_device_count`` once, when the CPU backend starts, so this conftest
(loaded by pytest before any test module under tests/jax imports jax) appends the flag to
``XLA_FLAGS``. If JAX was already initialised by something else in the same process, the sharding
tests skip with that reason. Without JAX installed, every test here is skipped.
"""

import importlib.util
import os

# 4 host devices for the mesh tests; LLVM optimisation level 0 halves XLA:CPU compile times (it
# changes how fast the CPU code runs, not what it computes).
_FLAGS = ("--xla_force_host_platform_device_count=4", "--xla_backend_optimization_level=0")

for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("flax") is None:
    collect_ignore_glob = ["test_*.py", "flax/test_*.py"]
