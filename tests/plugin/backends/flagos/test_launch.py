"""The cached launch path (flagos/_launch.py) against Triton's own launch of the same kernel.

Its launch key must refine Triton's specialization: two calls with one key must get one compiled
kernel from Triton, and every launch through the cache must write what Triton's launch writes.

Without a GPU (``TRITON_INTERPRET=1``, as CI runs this file against the oldest and the newest supported
Triton: .ci/run) the tests still exercise the parts that depend on the Triton version: whether
``cached_launch`` wraps a kernel (``triton.knobs``, 3.4+), the launcher generated from a ``JITFunction``'s
parameters (bound without a driver), the launch hook chains (3.5+) and Triton 3.6's direct C launch.
"""

import re

import pytest
import torch
import triton

from transformer_engine.plugin.backends.flagos import _launch
from transformer_engine.plugin.backends.flagos import quantization as fq
from transformer_engine.plugin.backends.flagos._common import INTERPRET


def test_interpreted_kernels_are_not_wrapped():
    """Under the interpreter every launch is Triton's (there is nothing compiled to cache)."""
    assert isinstance(fq._quantize_kernel, _launch.CachedLaunch) is not INTERPRET


def test_arg_key_separates_what_triton_specializes():
    key = _launch._arg_key
    assert key(1) != key(2) and key(16) == key(32) and key(16) != key(17)  # == 1, multiple of 16
    assert key(2**31 + 16) != key(16) and key(-16) != key(16)  # int32 / int64 / signed range
    assert key(a=True) != key(a=False) != key(None) and key(0.5) == key(2.0)  # floats are never specialized
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert key(x) == key(x[8:]) != key(x[1:]) != key(x.float())  # 16-byte alignment, dtype


def test_empty_launch_hook_chains_are_skipped():
    """Triton's hook chains exist even when empty: those reach the launcher as None (no launch
    metadata built, nothing called); a chain with a hook, or a plain callable, is passed on."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs, "HookChain"):
        pytest.skip("this Triton keeps launch hooks as plain callables")
    chain = knobs.HookChain()
    assert _launch._hooks(chain) is None and _launch._hooks(None) is None
    chain.add(print)
    assert _launch._hooks(chain) is chain and _launch._hooks(print) is print


def _probe_kernel_function():
    """The probe kernel as a plain Python function (not yet decorated)."""
    import triton.language as tl

    def _probe_kernel(x_ptr, y_ptr, n, k, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (x * alpha + (k % 7) + SHIFT).to(y_ptr.dtype.element_ty), mask=mask)

    return _probe_kernel


def _probe_kernel_source():
    return triton.jit(_probe_kernel_function())


def _compiled_jit_function():
    """The probe kernel as the ``JITFunction`` that ``@triton.jit`` makes without the interpreter (what
    ``cached_launch`` sees on a GPU); making it needs no driver, so this runs on the CPU too."""
    from triton.runtime.jit import JITFunction

    return JITFunction(_probe_kernel_function())


def _triton_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2]) >= (major, minor)


def test_triton_version_gates_match_the_installed_triton():
    """The module's view of the Triton version: knobs from 3.4 on, the direct C launch only under 3.6."""
    assert (_launch.knobs is not None) is _triton_at_least(3, 4)
    assert _launch._TRITON_3_6 is triton.__version__.startswith("3.6.")


@pytest.mark.parametrize("interpret", [True, False])
def test_cached_launch_wraps_a_compiled_kernel_only_where_it_can(interpret, monkeypatch):
    """Under the interpreter, or on a Triton older than 3.4 (no ``triton.knobs``), the kernel is left to
    Triton; otherwise a ``JITFunction`` gets the cached launcher."""
    jit_fn = _compiled_jit_function()
    monkeypatch.setattr(_launch, "INTERPRET", interpret)
    wrapped = _launch.cached_launch(jit_fn)
    if interpret or _launch.knobs is None:
        assert wrapped is jit_fn
    else:
        assert isinstance(wrapped, _launch.CachedLaunch) and wrapped.fn is jit_fn


def test_generated_launcher_binds_this_tritons_parameters():
    """The launcher generated from this Triton's ``JITFunction.params`` (3.4+): arguments bind by name and in
    order, constexprs are keyed by value, tensors by dtype and 16-byte alignment, launch options by name."""
    if _launch.knobs is None:
        pytest.skip(f"Triton {triton.__version__} < 3.4: cached_launch leaves every kernel to Triton's own launch")
    cached = _launch.CachedLaunch(_compiled_jit_function())
    cached._namespace["_device"] = lambda: 0  # no GPU driver here: the device is the only part bound on first use
    x = torch.zeros(64, dtype=torch.bfloat16)
    key = cached.launch_key(x, x[8:], 16, 2**33, 0.5, BLOCK=64, SHIFT=3)
    assert key == (0, _launch.knobs.runtime.debug, _launch._arg_key(x), _launch._arg_key(x[8:]), _launch._arg_key(16),
                   _launch._arg_key(2**33), float, 64, 3, ())
    assert cached.launch_key(x, x[8:], n=16, k=2**33, alpha=0.5, BLOCK=64, SHIFT=3) == key
    assert cached.launch_key(x, x[1:], 16, 2**33, 0.5, BLOCK=64, SHIFT=3) != key  # misaligned pointer
    assert cached.launch_key(x, x[8:], 16, 2**33, 0.5, BLOCK=128, SHIFT=3) != key  # another constexpr
    assert cached.launch_key(x, x[8:], 16, 2**33, 0.5, BLOCK=64, SHIFT=3, num_warps=2)[-1] == (("num_warps", 2),)
    with pytest.raises(TypeError):
        cached.launch_key(x, x, 16, 2**33, 0.5)  # BLOCK and SHIFT have no default
    assert cached[lambda meta: (1,)] is not None  # a callable grid goes to Triton's own launch (no key)


def test_launcher_refuses_parameter_names_it_reserves():
    if _launch.knobs is None:
        pytest.skip(f"Triton {triton.__version__} < 3.4: no cached launcher")
    from triton.runtime.jit import JITFunction

    def _bad_kernel(_grid, n):
        pass

    with pytest.raises(ValueError, match="start with '_'"):
        _launch.CachedLaunch(JITFunction(_bad_kernel))


class CudaLauncher:
    """A stand-in for Triton 3.6's compiled launcher (the direct path checks its type name and attributes)."""

    def __init__(self, global_scratch_size=0, profile_scratch_size=0):
        self.global_scratch_size, self.profile_scratch_size = global_scratch_size, profile_scratch_size
        self.launch, self.launch_cooperative_grid, self.launch_pdl = print, False, True


def test_direct_launch_only_under_triton_3_6_without_scratch_memory():
    """Triton 3.6's ``CudaLauncher.__call__`` is bypassed (its C launch called directly) only under 3.6 and
    only for a kernel without global or profile scratch memory; every other launch goes through ``run``."""
    direct = _launch._direct_launch(CudaLauncher())
    assert direct == ((print, False, True) if _launch._TRITON_3_6 else None)
    assert _launch._direct_launch(CudaLauncher(global_scratch_size=128)) is None
    assert _launch._direct_launch(CudaLauncher(profile_scratch_size=64)) is None
    assert _launch._direct_launch(object()) is None  # another launcher type (HIP, a later Triton's)


@pytest.mark.gpu
def test_cached_launch_matches_triton_launch():
    """Interleaved calls that differ in every specialized property: the cached path writes what
    Triton's path writes, and calls sharing a launch key share Triton's compiled kernel."""
    jit_fn = _probe_kernel_source()
    cached = _launch.CachedLaunch(jit_fn)
    base = torch.randn(4096 + 64, device="cuda")
    calls = []
    for dtype in (torch.float32, torch.bfloat16):
        x = base.to(dtype)
        for offset in (0, 1, 8):  # 16-byte aligned or not, depending on the dtype
            for n in (1, 16, 17, 4096):
                for k in (1, 16, 23, 2**33 + 5):
                    for block, shift in ((64, 0), (128, 3)):
                        calls.append((x[offset:], n, k, 0.5 + n % 3, block, shift))
    kernels = {}
    for _ in range(2):  # the second round hits the cache for every key
        for x, n, k, alpha, block, shift in calls:
            grid = (-(-n // block),)
            y_fast, y_ref = torch.full_like(x, -1.0), torch.full_like(x, -1.0)
            cached[grid](x, y_fast, n, k, alpha, BLOCK=block, SHIFT=shift)
            compiled = jit_fn[grid](x, y_ref, n, k, alpha, BLOCK=block, SHIFT=shift)
            assert torch.equal(y_fast, y_ref), (x.dtype, x.data_ptr() % 16, n, k, block)
            key = cached.launch_key(x, y_fast, n, k, alpha, BLOCK=block, SHIFT=shift)
            assert kernels.setdefault(key, compiled) is compiled, "one launch key, two compiled kernels"
    assert len(cached._compiled) == len(kernels)


@pytest.mark.gpu
def test_cached_launch_calls_registered_launch_hooks():
    """A hook added to Triton's launch chain (a profiler's, say) runs on the cached path too."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs, "HookChain"):
        pytest.skip("this Triton keeps launch hooks as plain callables")
    cached = _launch.CachedLaunch(_probe_kernel_source())
    x = torch.randn(256, device="cuda")
    y = torch.empty_like(x)
    cached[(4,)](x, y, 256, 3, 0.5, BLOCK=64, SHIFT=0)  # first call: Triton's path, compiles
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        cached[(4,)](x, y, 256, 3, 0.5, BLOCK=64, SHIFT=0)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    cached[(4,)](x, y, 256, 3, 0.5, BLOCK=64, SHIFT=0)  # removed again: not called
    assert seen == ["_probe_kernel"]
