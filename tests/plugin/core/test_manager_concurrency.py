"""OpManager under concurrency: dispatch and registration from threads, and behaviour after fork."""

import os
import select
import signal
import threading
import time
import warnings

import pytest

from tests.plugin.core._plugin_fakes import FakeTensor, make_impl, three_kinds
from transformer_engine.plugin.core import OpManager, OpRegistry, declare, devices, reset_global_policy, with_preference

X = FakeTensor()


# -- threads -----------------------------------------------------------------------------------
def test_concurrent_dispatch_with_per_thread_policies_while_registering():
    manager = three_kinds()
    expected = {"flagos": "flagos.triton", "vendor": "vendor.acme", "reference": "reference.torch"}
    barrier, stop = threading.Barrier(7), threading.Event()
    errors = []

    def caller(prefer):
        try:
            barrier.wait(10)
            with with_preference(prefer):
                for _ in range(300):
                    result = manager.call("relu", FakeTensor(dtype=("float32", "bfloat16")[_ % 2]))
                    assert result in (expected[prefer], "flagos.late"), (prefer, result)
        except Exception as exc:  # noqa: BLE001 - collected for the main thread
            errors.append(exc)

    def churn():
        barrier.wait(10)
        while not stop.is_set():
            manager.registry.register(make_impl("vendor.churn", priority=1))  # never first: low priority
            manager.registry.unregister("relu", "vendor.churn")
            manager.clear_cache()

    threads = [threading.Thread(target=caller, args=(p,)) for p in ("flagos", "vendor", "reference") * 2]
    threads.append(threading.Thread(target=churn))
    for t in threads:
        t.start()
    for t in threads[:-1]:
        t.join(60)
    stop.set()
    threads[-1].join(10)
    assert errors == []


def test_concurrent_first_calls_initialise_once():
    count = []

    class CountingManager(OpManager):
        def ensure_initialized(self):
            if not self._initialized:
                with self._init_lock:
                    if not self._initialized:
                        count.append(1)
            super().ensure_initialized()

    registry = OpRegistry()
    registry.register(make_impl("reference.torch"))
    manager = CountingManager(registry, load_builtins=False, discover=False)
    barrier = threading.Barrier(8)
    results = []

    def worker():
        barrier.wait(10)
        results.append(manager.call("relu", X))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == ["reference.torch"] * 8 and count == [1]


# -- fork --------------------------------------------------------------------------------------
def _run_in_child(fn, timeout: float = 30.0) -> str:
    """fork(); the child runs ``fn`` and reports ``repr(result)`` (or the error) through a pipe."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        os.close(read_end)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = repr((fn(), [str(w.message) for w in caught]))
        except BaseException as exc:  # noqa: BLE001
            out = f"error: {exc!r}"
        os.write(write_end, out.encode())
        os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            pytest.fail("the forked child hung (a lock held at fork time was never released in the child)")
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@fork_only
def test_child_after_fork_dispatches_without_re_registering():
    manager = three_kinds()
    assert manager.call("relu", X) == "flagos.triton"
    epoch = manager.registry.epoch

    def child():
        return manager.call("relu", X), manager.registry.epoch, len(manager.registry.get_implementations("relu"))

    assert _run_in_child(child) == repr((("flagos.triton", epoch, 3), []))


@fork_only
def test_child_after_fork_initialises_a_manager_that_was_never_used():
    manager = three_kinds()

    def child():
        with with_preference("reference"):
            return manager.call("relu", X)

    assert _run_in_child(child) == repr(("reference.torch", []))
    assert manager.call("relu", X) == "flagos.triton"


@fork_only
def test_locks_held_by_another_thread_at_fork_time_do_not_deadlock_the_child(fake_gpu_probe, restore_catalog):
    from transformer_engine.plugin.core import catalog, policy

    manager = three_kinds()
    manager.call("relu", X)
    held, release = threading.Event(), threading.Event()
    locks = [manager.registry._lock, manager._init_lock, devices._lock, policy._global_lock, catalog._LOCK]

    def holder():
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait(60)
        for lock in reversed(locks):
            lock.release()

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(10)

    def child():
        reset_global_policy()
        manager.registry.register(make_impl("flagos.child", priority=999))

        @declare
        def tefl_test_child_op(x):
            """y = x."""

        return manager.call("relu", FakeTensor(fake_gpu_probe, index=0)), manager.registry.epoch > 0

    try:
        result = _run_in_child(child, timeout=20.0)
    finally:
        release.set()
        thread.join(10)
    assert result == repr((("flagos.child", True), []))


@fork_only
def test_fork_from_a_thread_while_others_dispatch():
    manager = three_kinds()
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            manager.call("relu", FakeTensor(dtype="float16"))
            time.sleep(0)

    workers = [threading.Thread(target=busy) for _ in range(2)]
    for t in workers:
        t.start()
    try:
        for _ in range(3):
            assert _run_in_child(lambda: manager.call("relu", X), timeout=20.0) == repr(("flagos.triton", []))
    finally:
        stop.set()
        for t in workers:
            t.join(10)
