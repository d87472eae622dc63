import logging, sys, torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
logging.basicConfig(level=logging.DEBUG, stream=open("/dev/null","w"))
logging.getLogger().setLevel(logging.DEBUG)
recipe = DelayedScaling()
with te.quantized_model_init(recipe=recipe):
    m = te.LayerNormMLP(32, 64, params_dtype=torch.bfloat16)
def step(x):
    with te.autocast(recipe=recipe):
        return m(x)
f = torch.compile(step, fullgraph=True, backend=sys.argv[1])
x = torch.randn(32, 32, dtype=torch.bfloat16, requires_grad=True)
f(x).float().sum().backward()
print("ok", sys.argv[1])
