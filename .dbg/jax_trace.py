"""Time of tracing / lowering / compiling the JAX headline layer step on CPU (shapes from argv), per phase."""
import sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from bench_jax_transformer import Problem, _layer, RECIPES
import transformer_engine.jax as te
p = Problem(batch=1, seqlen=int(sys.argv[2]), hidden=int(sys.argv[3]), ffn=4 * int(sys.argv[3]), heads=int(sys.argv[3]) // 128)
recipe = RECIPES[sys.argv[1]]
layer = _layer(p)
keys = jax.random.split(jax.random.PRNGKey(0), 4)
x = jax.random.normal(keys[0], (p.batch, p.seqlen, p.hidden), jnp.bfloat16)
dy = jax.random.normal(keys[1], x.shape, jnp.bfloat16)
with te.autocast(enabled=recipe is not None, recipe=recipe):
    t = time.perf_counter()
    variables = jax.jit(lambda: layer.init({"params": keys[2], "dropout": keys[3]}, x))()
    jax.block_until_ready(variables)
    t_init = time.perf_counter() - t
    def loss(variables, x, dy, rng):
        out = layer.apply(variables, x, rngs={"dropout": rng})
        return (out.astype(jnp.float32) * dy.astype(jnp.float32)).sum(), out
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    t = time.perf_counter(); traced = step.trace(variables, x, dy, keys[3]); t_trace = time.perf_counter() - t
    t = time.perf_counter(); lowered = traced.lower(); t_lower = time.perf_counter() - t
    t = time.perf_counter(); compiled = lowered.compile(); t_compile = time.perf_counter() - t
n_eqns = len(traced.jaxpr.jaxpr.eqns)
hlo_lines = len(lowered.as_text().splitlines())
print(f"{sys.argv[1]} s={p.seqlen} h={p.hidden}: init {t_init:.1f}s trace {t_trace:.2f}s lower {t_lower:.2f}s compile {t_compile:.1f}s; jaxpr eqns {n_eqns}, stablehlo lines {hlo_lines}")
