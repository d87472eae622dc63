"""fast_launch: same kernels and results as ``kernel[grid](...)``, fewer host steps.

Three tiers:
- results: decorated vs undecorated kernels on the test device (CPU: the interpreter, where
  fast_launch returns the kernel itself; GPU: the fast path), several dtypes and a misaligned view;
- the fast path's logic on CPU: Triton's real ``JITFunction.run`` (kwargs, binder, cache key, grid,
  hooks, global check) on a fake device whose compile makes recording kernels, so every choice of the
  fast path is compared with the kernel Triton's own run picks;
- GPU-only: the fast path is taken (Triton's run is made to fail after the warm-up) and matches.
"""

from __future__ import annotations

import doctest
import inspect
import random

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel
from triton.runtime import jit as triton_jit
from triton.runtime.driver import driver

from tests.plugin.backends.flagos._helpers import HP_DTYPES, assert_close
from transformer_engine.plugin.backends.flagos import _launch
from transformer_engine.plugin.backends.flagos._launch import fast_launch

# the nvidia backend's option parser warns once about a Triton 3.10 default change
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION is unset")


# Kernels are jitted inside the tests (not decorated here): on CPU the conftest sets TRITON_INTERPRET=1
# only while a test runs, and triton.jit picks the interpreter at decoration time.
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, RELU: tl.constexpr):
    """out = alpha * x + y (then max(., 0) when RELU), in float32, stored in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)  # x_ptr: [n]
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)  # y_ptr: [n]
    r = alpha * x + y
    if RELU:
        r = tl.maximum(r, 0.0)
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=mask)  # out_ptr: [n]


def _scale_rows_kernel(x_ptr, out_ptr, cols, stride_row, scale, BLOCK: tl.constexpr):
    """out[i, j] = scale * x[i, j]; grid (rows, cdiv(cols, BLOCK))."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * stride_row + offs, mask=mask).to(tl.float32)  # x_ptr: [rows, stride_row]
    tl.store(out_ptr + row * cols + offs, (scale * x).to(out_ptr.dtype.element_ty), mask=mask)  # out_ptr: [rows, cols]


def _axpy(kernel, x, y, alpha, relu, block=32):
    out = torch.empty_like(y)
    n = y.numel()
    kernel[lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),)](x, y, out, n, alpha, BLOCK=block, RELU=relu)
    return out


def _scale_rows(kernel, x, scale, block=16):
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    kernel[(rows, triton.cdiv(cols, block))](x, out, cols, x.stride(0), scale, BLOCK=block, num_warps=2)
    return out


def _axpy_expected(x, y, alpha, relu):
    r = alpha * x.float() + y.float()  # the kernel's float32 formula
    return (r.clamp_min(0) if relu else r).to(y.dtype)


# ---------------------------------------------------------------------------------------------
# results on the test device
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HP_DTYPES)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_decorated_kernel_gives_the_undecorated_results(device, dtype, offset):
    plain, wrapped = triton.jit(_axpy_kernel), triton.jit(_axpy_kernel)
    fast = fast_launch(wrapped)
    if device == "cpu":  # the interpreter: the normal path, no wrapper
        assert fast is wrapped
    else:
        assert isinstance(fast, _launch._FastKernel)
    n = 97  # prime: a partial last block
    base = torch.randn(n + offset, device=device).to(dtype)
    x, y = base[offset:], torch.randn(n, device=device).to(dtype)
    for relu in (False, True):
        expected = _axpy(plain, x, y, 0.75, relu)
        for _ in range(2):  # first call compiles (normal path), the second is a cache hit
            got = _axpy(fast, x, y, 0.75, relu)
            assert torch.equal(got, expected)
        assert_close(got, _axpy_expected(x, y, 0.75, relu))


def test_two_dimensional_grid_matches(device):
    plain, fast = triton.jit(_scale_rows_kernel), fast_launch(triton.jit(_scale_rows_kernel))
    x = torch.randn(5, 41, device=device)[:, 1:]  # strided rows, odd width
    for _ in range(2):
        assert torch.equal(_scale_rows(fast, x, 1.5), _scale_rows(plain, x, 1.5))


# ---------------------------------------------------------------------------------------------
# what is wrapped, what is returned as is
# ---------------------------------------------------------------------------------------------


def test_non_jit_objects_and_interpreted_kernels_are_returned_as_is(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    interpreted = triton.jit(_axpy_kernel)
    assert not isinstance(interpreted, triton_jit.JITFunction)
    assert fast_launch(interpreted) is interpreted
    autotuned = triton.autotune(configs=[triton.Config({})], key=["n"])(triton_jit.JITFunction(_axpy_kernel))
    assert fast_launch(autotuned) is autotuned


def test_subclass_overriding_run_is_returned_as_is():
    class _OwnRun(triton_jit.JITFunction):
        def run(self, *args, grid, warmup, **kwargs):
            return None

    kernel = _OwnRun(_axpy_kernel)
    assert "overrides JITFunction.run" in _launch._support_problem(kernel)
    assert fast_launch(kernel) is kernel


def test_wrapper_passes_attributes_through():
    jit_fn = triton_jit.JITFunction(_axpy_kernel)
    fast = fast_launch(jit_fn)
    assert isinstance(fast, _launch._FastKernel)
    assert fast.fn is _axpy_kernel and fast.__name__ == "_axpy_kernel" and fast.arg_names == jit_fn.arg_names
    assert repr(fast) == f"fast_launch({jit_fn!r})"
    with pytest.raises(AttributeError):
        fast.no_such_attribute  # noqa: B018


def test_docstring_example_runs():
    assert doctest.testmod(_launch, raise_on_error=True).attempted > 0


# ---------------------------------------------------------------------------------------------
# reading Triton's run: the installed one, and variants it must refuse
# ---------------------------------------------------------------------------------------------


def _installed_sources():
    rules, problem = _launch._installed_run_rules()
    if rules is None:
        pytest.skip(f"the installed Triton takes the normal path: {problem}")
    return inspect.getsource(triton_jit.JITFunction.run), inspect.getsource(triton_jit.compute_cache_key)


#: Triton versions whose JITFunction.run was read against this module (the GPU host runs 3.6.0).
_VERIFIED_TRITON = ("3.6.0", "3.9.0")


def test_installed_triton_run_is_understood():
    rules, problem = _launch._installed_run_rules()
    if triton.__version__.split("+")[0] not in _VERIFIED_TRITON and rules is None:
        pytest.skip(f"Triton {triton.__version__} takes the normal path: {problem}")
    assert problem == ""
    names = [rule.name for rule in rules.options]
    assert names[:2] == ["debug", "instrumentation_mode"]  # Triton 3.6 and 3.9 both set these, first
    assert rules.options[0] == _launch._OptionRule("debug", "runtime", "debug", "debug")
    assert {"launch_enter_hook", "launch_exit_hook"} <= set(rules.hooks)


def _after_line(source: str, marker: str, new_line: str) -> str:
    """source with ``new_line`` inserted after the line containing ``marker``, same indentation."""
    lines = source.splitlines()
    at = next(i for i, line in enumerate(lines) if marker in line)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    return "\n".join(lines[: at + 1] + [indent + new_line] + lines[at + 1 :])


@pytest.mark.parametrize(
    "marker, new_line, reason",
    [
        ('kwargs["debug"]', 'kwargs["mode"] = pick_mode()', "changes its kwargs"),
        ('kwargs["debug"]', 'kwargs.pop("num_warps", None)', "changes its kwargs"),
        ("= binder(*args, **kwargs)", 'options["extra"] = 1', "before computing the key"),
        ("= binder(*args, **kwargs)", "specialization.append(1)", "before computing the key"),
        ("stream = driver.active", "knobs.runtime.new_launch_mode = 1", "reads knobs.runtime.new_launch_mode"),
    ],
    ids=["unknown-option-value", "kwargs-pop", "options-changed", "specialization-changed", "unknown-knob"],
)
def test_run_variants_this_module_does_not_mirror_are_refused(marker, new_line, reason):
    run_source, key_source = _installed_sources()
    rules, problem = _launch._parse_run_rules(_after_line(run_source, marker, new_line), key_source)
    assert rules is None and reason in problem


def test_missing_statement_and_key_with_knobs_are_refused():
    run_source, key_source = _installed_sources()
    no_launch = run_source.replace("kernel.run(", "kernel.launch(")
    assert "has no statement 'kernel.run(" in _launch._parse_run_rules(no_launch, key_source)[1]
    knob_key = _after_line(key_source, "key = (tuple(specialization), str(options))", "key += (knobs.x.y,)")
    assert "compute_cache_key depends" in _launch._parse_run_rules(run_source, knob_key)[1]


def test_a_new_knob_option_line_becomes_a_rule():
    run_source, key_source = _installed_sources()
    variant = _after_line(run_source, 'kwargs["debug"]', 'kwargs["new_opt"] = knobs.compilation.new_opt')
    rules, problem = _launch._parse_run_rules(variant, key_source)
    assert problem == "" and rules.options[1] == _launch._OptionRule("new_opt", "compilation", "new_opt")


# ---------------------------------------------------------------------------------------------
# grid canonicalisation and small helpers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid, dims",
    [((7,), (7, 1, 1)), ([7, 3], (7, 3, 1)), ((7, 3, 2), (7, 3, 2)), ((7, 3, 2, 9), (7, 3, 2))],
)
def test_grid_dims_pads_with_ones(grid, dims):
    assert _launch._grid_dims(grid, {}) == dims


def test_callable_grid_receives_the_bound_arguments():
    seen = []

    def grid(meta):
        seen.append(dict(meta))
        return (triton.cdiv(meta["n"], meta["BLOCK"]), 2)

    assert _launch._grid_dims(grid, {"n": 100, "BLOCK": 32}) == (4, 2, 1)
    assert seen == [{"n": 100, "BLOCK": 32}]


def test_hook_active_understands_hook_chains_and_plain_hooks():
    chain = knobs.HookChain()
    assert not _launch._hook_active(None) and not _launch._hook_active(chain)
    chain.add(print)
    assert _launch._hook_active(chain) and _launch._hook_active(print)


# ---------------------------------------------------------------------------------------------
# the fast path on a fake device, against Triton's real run
# ---------------------------------------------------------------------------------------------


class _FakeDriver:
    """What JITFunction.run and create_binder use of the active driver, for a GPU that is not there."""

    def __init__(self):
        self.device = 0

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return 1000 + device

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class _FakeKernel(CompiledKernel):
    """A 'compiled' kernel whose launcher records each launch (nothing is compiled or loaded)."""

    def __init__(self, key: str):  # no super().__init__: there is no binary
        self.key, self.name, self.src = key, "fake", None
        self.module = self.function = object()
        self.packed_metadata = (4, 1, 0)
        self.launches = []
        self.error = None

    def __del__(self):  # nothing was loaded, nothing to unload
        pass

    def run(self, *args):  # CompiledKernel.run is the launcher
        if self.error is not None:
            raise self.error
        self.launches.append(args)


class _Harness:
    """A real JITFunction on the fake device: Triton's run does everything except compiling."""

    def __init__(self, fn=_axpy_kernel):
        self.jit_fn = triton_jit.JITFunction(fn)
        self.compiled, self.normal_launches = [], []
        real_run = self.jit_fn.run

        def do_compile(key, signature, device, constexprs, options, attrs, warmup):
            kernel = self.jit_fn.device_caches[device][0][key] = _FakeKernel(key)
            self.compiled.append(key)
            return kernel

        def counting_run(*args, **kwargs):
            self.normal_launches.append(kwargs["grid"])
            return real_run(*args, **kwargs)

        self.jit_fn._do_compile = do_compile
        self.jit_fn.run = counting_run
        self.fast = fast_launch(self.jit_fn)
        assert isinstance(self.fast, _launch._FastKernel)

    def fast_hit(self, grid, *args, **kwargs):
        """fast[grid](...) that must not reach Triton's run."""
        before = len(self.normal_launches)
        kernel = self.fast[grid](*args, **kwargs)
        assert len(self.normal_launches) == before, "expected a fast-path hit"
        return kernel


@pytest.fixture
def runtime_knobs():
    """knobs.runtime, whose settings made in the test are undone afterwards (as its scope() does)."""
    saved = dict(knobs.runtime.__dict__)
    yield knobs.runtime
    knobs.runtime.__dict__.clear()
    knobs.runtime.__dict__.update(saved)


@pytest.fixture
def fake_gpu(monkeypatch) -> _FakeDriver:
    fake = _FakeDriver()
    monkeypatch.setattr(driver, "_active", fake)
    return fake


def _variants():
    """Calls of _axpy_kernel that Triton specializes differently: dtype, alignment, ints, options."""
    x32, x16 = torch.randn(65), torch.randn(65).half()
    out = torch.empty(65)
    return {
        "fp32": ((x32, x32, out, 64, 0.5), dict(BLOCK=32, RELU=False)),
        "fp16 input": ((x16, x32, out, 64, 0.5), dict(BLOCK=32, RELU=False)),
        "misaligned input": ((x32[1:], x32, out, 64, 0.5), dict(BLOCK=32, RELU=False)),
        "n == 1 (constexpr)": ((x32, x32, out, 1, 0.5), dict(BLOCK=32, RELU=False)),
        "n odd": ((x32, x32, out, 63, 0.5), dict(BLOCK=32, RELU=False)),
        "int alpha": ((x32, x32, out, 64, 2), dict(BLOCK=32, RELU=False)),
        "BLOCK 64": ((x32, x32, out, 64, 0.5), dict(BLOCK=64, RELU=False)),
        "RELU": ((x32, x32, out, 64, 0.5), dict(BLOCK=32, RELU=True)),
        "num_warps 2": ((x32, x32, out, 64, 0.5), dict(BLOCK=32, RELU=False, num_warps=2)),
        "debug": ((x32, x32, out, 64, 0.5), dict(BLOCK=32, RELU=False, debug=True)),
        "positional constexprs": ((x32, x32, out, 64, 0.5, 32, False), {}),
    }


def _same_arg(a, b) -> bool:
    return a is b if torch.is_tensor(a) else type(a) is type(b) and a == b


def test_fast_path_launches_the_kernel_triton_picks(fake_gpu):
    h = _Harness()
    variants = list(_variants().items())
    picked = {}
    for name, (args, kwargs) in variants:
        picked[name] = h.jit_fn[(3,)](*args, **kwargs)  # Triton's run: compiles on a new key
        assert h.fast[(3,)](*args, **kwargs) is picked[name]  # our miss: Triton's run again, remembered
    # "positional constexprs" binds like "fp32": the same kernel, as in Triton
    assert picked["positional constexprs"] is picked["fp32"]
    assert len(h.compiled) == len(variants) - 1 == len(set(map(id, picked.values())))
    assert len(h.fast._kernels[0][1]) == len(variants) - 1
    random.Random(0).shuffle(variants)
    for name, (args, kwargs) in variants:
        kernel = h.fast_hit((3,), *args, **kwargs)
        assert kernel is picked[name], name
        hit, normal = kernel.launches[-1], kernel.launches[0]
        assert hit[:6] == normal[:6] == (3, 1, 1, 1000, kernel.function, kernel.packed_metadata)
        assert hit[6:9] == (None, None, None)  # no launch metadata, no hooks: nothing to call
        assert len(hit) == len(normal) and all(_same_arg(a, b) for a, b in zip(hit[9:], normal[9:]))


def test_knob_values_are_part_of_the_key(fake_gpu, runtime_knobs):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    plain = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    runtime_knobs.debug = True
    debug = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    assert debug is not plain and len(h.compiled) == 2
    assert h.fast_hit((1,), *args, BLOCK=32, RELU=False) is debug
    runtime_knobs.debug = False
    assert h.fast_hit((1,), *args, BLOCK=32, RELU=False) is plain


def test_callable_and_multi_dimensional_grids_on_a_hit(fake_gpu):
    h = _Harness()
    args = (torch.randn(100), torch.randn(100), torch.empty(100), 100, 0.5)
    grids = [lambda meta: (triton.cdiv(meta["n"], meta["BLOCK"]),), (2, 3), [2, 3, 4]]
    for grid, dims in zip(grids, [(4, 1, 1), (2, 3, 1), (2, 3, 4)]):
        h.fast[grid](*args, BLOCK=32, RELU=False)
        kernel = h.fast_hit(grid, *args, BLOCK=32, RELU=False)
        assert kernel.launches[-1][:3] == dims


def test_devices_have_their_own_kernels_and_streams(fake_gpu):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    on_0 = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    fake_gpu.device = 1
    on_1 = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    assert on_1 is not on_0 and h.fast_hit((1,), *args, BLOCK=32, RELU=False) is on_1
    assert on_1.launches[-1][3] == 1001
    fake_gpu.device = 0
    assert h.fast_hit((1,), *args, BLOCK=32, RELU=False) is on_0 and on_0.launches[-1][3] == 1000


def test_reset_device_caches_are_not_served_stale_kernels(fake_gpu):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    old = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    h.jit_fn.device_caches.clear()
    new = h.fast[(1,)](*args, BLOCK=32, RELU=False)  # a new binder and kernel cache: a miss, recompiled
    assert new is not old and len(h.compiled) == 2
    assert h.fast_hit((1,), *args, BLOCK=32, RELU=False) is new


@pytest.mark.parametrize("hook_name", ["launch_enter_hook", "launch_exit_hook"])
def test_launch_hooks_take_triton_run(fake_gpu, runtime_knobs, hook_name):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    h.fast[(1,)](*args, BLOCK=32, RELU=False)
    chain = knobs.HookChain()
    chain.add(lambda metadata: None)
    setattr(runtime_knobs, hook_name, chain)
    kernel = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    assert len(h.normal_launches) == 2 and kernel.launches[-1][6:9].count(chain) == 1


def test_stages_inspection_hook_takes_triton_run(fake_gpu, runtime_knobs):
    if "add_stages_inspection_hook" not in _launch._installed_run_rules()[0].hooks:
        pytest.skip("this Triton's run has no stages-inspection hook")
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    plain = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    runtime_knobs.add_stages_inspection_hook = lambda: ("stages", "hash")  # run adds it to the key
    inspected = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    assert inspected is not plain and len(h.normal_launches) == 2 and len(h.compiled) == 2


def test_pre_run_hooks_take_triton_run(fake_gpu):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    h.fast[(1,)](*args, BLOCK=32, RELU=False)
    seen = []
    h.jit_fn.add_pre_run_hook(lambda *a, **kw: seen.append(kw["BLOCK"]))
    h.fast[(1,)](*args, BLOCK=32, RELU=False)
    assert seen == [32] and len(h.normal_launches) == 2


def test_changed_global_raises_tritons_error(fake_gpu):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    h.fast[(1,)](*args, BLOCK=32, RELU=False)
    module_globals = {"SCALE": 1}
    h.jit_fn.used_global_vals = {("SCALE", id(module_globals)): (1, module_globals)}  # as Triton records it
    h.fast_hit((1,), *args, BLOCK=32, RELU=False)
    module_globals["SCALE"] = 2
    with pytest.raises(RuntimeError, match="Global variable SCALE has changed"):
        h.fast[(1,)](*args, BLOCK=32, RELU=False)


def test_launch_errors_propagate_from_the_fast_path(fake_gpu):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    kernel = h.fast[(1,)](*args, BLOCK=32, RELU=False)
    kernel.error = ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
    with pytest.raises(ValueError, match="cpu tensor"):
        h.fast_hit((1,), *args, BLOCK=32, RELU=False)


def test_binding_errors_are_tritons(fake_gpu):
    h = _Harness()
    args = (torch.randn(64), torch.randn(64), torch.empty(64), 64, 0.5)
    h.fast[(1,)](*args, BLOCK=32, RELU=False)
    with pytest.raises(TypeError, match="RELU"):
        h.fast[(1,)](*args, BLOCK=32)
    with pytest.raises(KeyError, match="num_wraps"):
        h.fast[(1,)](*args, BLOCK=32, RELU=False, num_wraps=4)  # a miss: Triton's run checks options


# ---------------------------------------------------------------------------------------------
# GPU: the fast path is really taken
# ---------------------------------------------------------------------------------------------


def _fail_run(*args, **kwargs):
    raise AssertionError("Triton's JITFunction.run was called: the fast path was not taken")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP_DTYPES)
def test_gpu_fast_path_is_taken_and_matches(dtype):
    plain, wrapped = triton.jit(_axpy_kernel), triton.jit(_axpy_kernel)
    fast = fast_launch(wrapped)
    assert isinstance(fast, _launch._FastKernel)
    base = torch.randn(1001, device="cuda").to(dtype)
    # (x, y, alpha, relu): one input misaligned by an element each time, then an int alpha
    calls = [
        (base[:1000], base[1:], 0.5, False),
        (base[1:], base[:1000], -2.0, True),
        (base[:1000], base[:1000], 3, False),
    ]
    expected = [_axpy(plain, x, y, a, r) for x, y, a, r in calls]
    for x, y, a, r in calls:  # warm-up: compile through Triton's run
        _axpy(fast, x, y, a, r)
    wrapped.run = _fail_run
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs and expected results are on the default stream
    with torch.cuda.stream(stream):  # the launch goes to the current stream
        got = [_axpy(fast, x, y, a, r) for x, y, a, r in calls]
    stream.synchronize()
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert len(fast._kernels[torch.cuda.current_device()][1]) == len(calls)


@pytest.mark.gpu
def test_gpu_two_dimensional_grid_fast_path():
    plain, wrapped = triton.jit(_scale_rows_kernel), triton.jit(_scale_rows_kernel)
    fast = fast_launch(wrapped)
    x = torch.randn(7, 300, device="cuda", dtype=torch.bfloat16)[:, 1:]
    _scale_rows(fast, x, 0.25)
    wrapped.run = _fail_run
    assert torch.equal(_scale_rows(fast, x, 0.25), _scale_rows(plain, x, 0.25))


@pytest.mark.gpu
def test_gpu_launch_hooks_still_fire():
    fast = fast_launch(triton.jit(_axpy_kernel))
    x = torch.randn(64, device="cuda")
    _axpy(fast, x, x, 1.0, False)
    chain = knobs.runtime.launch_enter_hook
    if not isinstance(chain, knobs.HookChain):
        pytest.skip("this Triton's launch_enter_hook is not a HookChain")
    seen = []

    def hook(metadata):
        seen.append(metadata)

    chain.add(hook)
    try:
        _axpy(fast, x, x, 1.0, False)
    finally:
        chain.remove(hook)
    assert len(seen) == 1
