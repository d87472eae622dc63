import copy, sys, torch
sys.path.insert(0, "tests/pytorch")
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling, Format
RECIPES = {"bf16": None, "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4), "current": Float8CurrentScaling()}
def step_fn(m, r):
    def step(x):
        if r is None: return m(x)
        with te.autocast(recipe=r): return m(x)
    return step
def train(step, m, xs):
    opt = torch.optim.SGD(m.parameters(), lr=0.1); outs = []
    for x in xs:
        x = x.clone().requires_grad_(True); y = step(x); y.float().square().sum().backward(); opt.step(); opt.zero_grad()
        outs.append((y.detach().clone(), x.grad.clone()))
    return outs
for mod_name, build in [("Linear", lambda: te.Linear(64, 32)), ("LNLinear", lambda: te.LayerNormLinear(64, 48))]:
    for rn in sys.argv[1].split(","):
        for backend in ["aot_eager", "inductor"]:
            torch._dynamo.reset(); torch.manual_seed(0)
            with torch.device("cuda"):
                eager = build().to(torch.bfloat16); xs = [torch.randn(256, 64, dtype=torch.bfloat16) for _ in range(4)]
            r = RECIPES[rn]
            train(step_fn(eager, r), eager, xs[:1]); comp = copy.deepcopy(eager)
            c = torch.compile(step_fn(comp, r), fullgraph=True, backend=backend)
            try:
                res = [(float((yc.float()-ye.float()).abs().max()), float((dc.float()-de.float()).abs().max())) for (ye, de), (yc, dc) in zip(train(step_fn(eager, r), eager, xs[1:]), train(c, comp, xs[1:]))]
                print(mod_name, rn, backend, res, flush=True)
            except Exception as e:
                print(mod_name, rn, backend, "ERR", str(e).splitlines()[0][:200], flush=True)
