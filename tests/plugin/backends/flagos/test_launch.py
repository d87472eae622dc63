"""The cached launch path (flagos/_launch.py) against Triton's own launch of the same kernel.

Its launch key must refine Triton's specialization: two calls with one key must get one compiled
kernel from Triton, and every launch through the cache must write what Triton's launch writes.
"""

import pytest
import torch

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
    assert key(True) != key(False) != key(None) and key(0.5) == key(2.0)  # floats are never specialized
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


def _probe_kernel_source():
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_kernel(x_ptr, y_ptr, n, k, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, (x * alpha + (k % 7) + SHIFT).to(y_ptr.dtype.element_ty), mask=mask)

    return _probe_kernel


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
