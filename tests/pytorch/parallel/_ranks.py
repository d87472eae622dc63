"""Multi-process test harness: a pool of spawned ranks that runs test functions on every rank.

Starting a rank (spawn + ``import torch`` + ``import transformer_engine``) takes seconds on a small
machine, so each (backend, world size) pool is started once per session and then runs many test
functions. ``pool.run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank (``fn`` must be importable: a
module-level function of a test module) and returns the per-rank results in rank order; an exception
on any rank fails the test with that rank's traceback. Every call is bounded by a timeout; a rank that
hangs (e.g. its peers died inside a collective) gets the pool killed and restarted for the next test.

gloo runs on the CPU; nccl puts rank r on GPU r (tests that use it carry the ``gpu`` marker and are
skipped when there are fewer GPUs than ranks). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import importlib
import os
import queue
import tempfile
import traceback
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.multiprocessing as mp

__all__ = ["RankPool", "device", "get_pool", "close_pools"]

_STARTUP_TIMEOUT_S = 180


def device() -> torch.device:
    """This rank's device: GPU ``rank`` under nccl, else (gloo, or no process group) the CPU."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _worker(rank: int, world_size: int, backend: str, init_file: str, tasks, results) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    importlib.import_module("transformer_engine.pytorch")  # warm the import before the first task

    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test with its traceback
            results.put((rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned ranks in one process group (see the module docstring)."""

    def __init__(self, world_size: int, backend: str = "gloo"):
        self.world_size, self.backend = world_size, backend
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="te_fl_pg_")
        os.close(fd)
        os.unlink(self._init_file)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, backend, self._init_file, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("ready", _STARTUP_TIMEOUT_S)

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def _collect(self, what: str, timeout: float) -> List[Any]:
        out: Dict[int, Tuple[str, Any]] = {}
        try:
            while len(out) < self.world_size:
                rank, status, value = self._results.get(timeout=timeout)
                out[rank] = (status, value)
        except queue.Empty:
            self.close(kill=True)
            missing = sorted(set(range(self.world_size)) - set(out))
            errors = "".join(v for s, v in out.values() if s == "error")
            raise TimeoutError(f"ranks {missing} of {self.world_size} gave no {what} within {timeout:.0f} s\n{errors}") from None
        errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(out.items()) if s == "error"]
        if errors:
            raise AssertionError("\n".join(errors))
        return [out[r][1] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout: float = 90.0, **kwargs) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; the results in rank order."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        return self._collect(f"result of {fn.__name__}", timeout)

    def stop(self, kill: bool = False) -> None:
        """Ask the ranks to stop (terminate them with ``kill``, e.g. after a timeout); :meth:`close` waits."""
        for p, q in zip(self._procs, self._tasks):
            if kill:
                p.terminate()
            elif p.is_alive():
                q.put(None)

    def close(self, kill: bool = False) -> None:
        """Stop the ranks and wait for them (killing any that hang)."""
        self.stop(kill)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if os.path.exists(self._init_file):
            os.unlink(self._init_file)


_POOLS: Dict[Tuple[str, int], RankPool] = {}


def get_pool(world_size: int, backend: str = "gloo") -> RankPool:
    """The session's pool of ``world_size`` ranks on ``backend`` (restarted if a test broke it)."""
    key = (backend, world_size)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close(kill=True)
        _POOLS[key] = pool = RankPool(world_size, backend)
    return pool


def close_pools() -> None:
    """Stop every pool (end of the session): all at once, then wait for each."""
    for pool in _POOLS.values():
        pool.stop()
    while _POOLS:
        _POOLS.popitem()[1].close()
