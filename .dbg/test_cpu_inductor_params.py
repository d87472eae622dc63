import copy, torch, pytest, sys
sys.path.insert(0, "tests/pytorch/quantization")
from test_model_init import _build, MODULES, _sgd_steps, _autocast_step, RECIPES, RECIPE_IDS

@pytest.mark.parametrize("recipe", RECIPES[:1], ids=RECIPE_IDS[:1])
def test_it(recipe):
    eager = _build("LayerNormMLP", recipe)
    xs = [torch.randn(32, 32, dtype=torch.bfloat16) for _ in range(3)]
    call = MODULES["LayerNormMLP"][1]
    _sgd_steps(_autocast_step(eager, call, recipe), eager, xs[:1])
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    step = torch.compile(_autocast_step(compiled, call, recipe), fullgraph=True)
    _sgd_steps(step, compiled, xs[1:])
