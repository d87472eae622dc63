"""Host time of one fwd+bwd step on CPU at a tiny shape: TE layer (bf16 / FP8 delayed) vs plain PyTorch."""
import sys, time, cProfile, pstats, torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling
torch.manual_seed(0)
H, S, B = 64, 8, 2
variant = sys.argv[1]
if variant == "plain":
    class Plain(torch.nn.Module):
        def __init__(s):
            super().__init__()
            s.ln1, s.qkv, s.proj = torch.nn.LayerNorm(H), torch.nn.Linear(H, 3 * H), torch.nn.Linear(H, H)
            s.ln2, s.fc1, s.fc2 = torch.nn.LayerNorm(H), torch.nn.Linear(H, 4 * H), torch.nn.Linear(4 * H, H)
        def forward(s, x):
            q, k, v = s.qkv(s.ln1(x)).view(S, B, 3, 1, H).unbind(2)
            a = torch.nn.functional.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, dropout_p=0.1)
            x = x + torch.nn.functional.dropout(s.proj(a.permute(2, 0, 1, 3).reshape(S, B, H)), 0.1)
            return x + torch.nn.functional.dropout(s.fc2(torch.nn.functional.gelu(s.fc1(s.ln2(x)))), 0.1)
    layer = Plain().to(torch.bfloat16)
    ctx = lambda: torch.autocast("cpu", enabled=False)
else:
    layer = te.TransformerLayer(H, 4 * H, 1, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.bfloat16, self_attn_mask_type="causal")
    recipe = DelayedScaling() if variant == "fp8" else None
    ctx = lambda: te.autocast(enabled=recipe is not None, recipe=recipe)
x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(S, B, H, dtype=torch.bfloat16)
def step():
    with ctx():
        y = layer(x)
    y.backward(dy)
for _ in range(20): step()
n = 200
t = time.perf_counter()
for _ in range(n): step()
print(f"{variant}: {1e3 * (time.perf_counter() - t) / n:.3f} ms/step")
if len(sys.argv) > 2:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(50): step()
    pr.disable()
    st = pstats.Stats(pr); st.sort_stats(sys.argv[2]).print_stats(45)
