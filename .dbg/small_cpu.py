import sys, time, cProfile, pstats, torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
v = sys.argv[1]
import os; DT = getattr(torch, os.environ.get("DT", "float32"))
torch.manual_seed(0)
x = torch.randn(16, 256, dtype=DT, requires_grad=True); dy = torch.randn(16, 256, dtype=DT)
if v == "plain":
    m = torch.nn.Linear(256, 256, dtype=DT); ctx = lambda: torch.autocast("cpu", enabled=False)
else:
    m = te.Linear(256, 256, params_dtype=DT); r = DelayedScaling() if v == "fp8" else None
    ctx = lambda: te.autocast(enabled=r is not None, recipe=r)
def step():
    with ctx():
        y = m(x)
    y.backward(dy)
for _ in range(50): step()
n = 2000
t = time.perf_counter()
for _ in range(n): step()
print(f"{v}: {1e6 * (time.perf_counter() - t) / n:.1f} us/step")
if len(sys.argv) > 2:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(500): step()
    pr.disable()
    pstats.Stats(pr).sort_stats(sys.argv[2]).print_stats(int(sys.argv[3]) if len(sys.argv) > 3 else 40)
