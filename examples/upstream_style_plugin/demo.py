"""Run TE-FL modules on the upstream-style example backend and compare them with the reference backend.

Needs the plugin importable and registered: ``pip install -e examples/upstream_style_plugin`` (entry
point) or ``TE_FL_PLUGIN_MODULES=te_fl_upstream_example`` with the package folder on ``PYTHONPATH``.

    python examples/upstream_style_plugin/demo.py

It switches the backend's availability probe on (``MYVENDOR_AVAILABLE=1``), then:
1. calls ``rmsnorm_fwd`` the upstream way, ``get_manager().call(...)``, which returns the plugin's
   own ``(output, rsigma)``;
2. runs ``te.RMSNorm`` followed by ``te.ops.SwiGLU`` forward and backward, once on the default
   selection (the plugin: priority 200 in the vendor kind, and ``flagos.triton`` declines the CPU)
   and once under ``with_preference("reference")``, and prints the largest differences;
3. prints the plugin's call counter and ``explain`` for one call.
"""

import os
import sys

os.environ.setdefault("MYVENDOR_AVAILABLE", "1")  # the example's stand-in for "the device is present"

import torch  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.plugin import explain, get_default_manager  # noqa: E402
from transformer_engine.plugin.core import get_manager, with_preference  # noqa: E402

HIDDEN, TOKENS = 48, 7  # odd token count on purpose


def _loaded() -> bool:
    manager = get_default_manager()
    manager.ensure_initialized()
    return any(r.ok and "vendor.myvendor" in r.impl_ids for r in manager.plugin_records)


def _run_block(norm, x):
    """SwiGLU(RMSNorm(x)): output and the gradients of x and of the norm's weight."""
    x = x.detach().requires_grad_(requires_grad=True)
    norm.weight.grad = None
    y = te.ops.SwiGLU()(norm(x))
    y.backward(torch.ones_like(y))
    return y.detach(), x.grad, norm.weight.grad.clone()


def main() -> int:
    if not _loaded():
        print("te_fl_upstream_example is not loaded: pip install -e examples/upstream_style_plugin, "
              "or set TE_FL_PLUGIN_MODULES=te_fl_upstream_example", file=sys.stderr)
        return 1
    import te_fl_upstream_example as plugin

    torch.manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN)
    output, rsigma = get_manager().call("rmsnorm_fwd", x, torch.ones(HIDDEN), eps=1e-5)
    print(f"get_manager().call('rmsnorm_fwd'): output {tuple(output.shape)}, rsigma {tuple(rsigma.shape)}")

    norm = te.RMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    plugin.CALLS.clear()
    on_plugin = _run_block(norm, x)
    print(f"calls on the plugin: {dict(sorted(plugin.CALLS.items()))}")
    with with_preference("reference"):
        on_reference = _run_block(norm, x)
    for name, a, b in zip(("output", "grad x", "grad weight"), on_plugin, on_reference):
        print(f"max |plugin - reference| {name}: {(a - b).abs().max().item():.3g}")

    for decision in explain("rmsnorm_fwd", x, norm.weight.detach(), 1e-5):
        print(f"explain rmsnorm_fwd: {decision.impl_id} {decision.status}: {decision.reason}")
    print("upstream_style_plugin demo done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
