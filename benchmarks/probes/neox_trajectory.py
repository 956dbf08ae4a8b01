"""Loss trajectory of a tiny GPT-NeoX (partial rotary, parallel residual) under bf16 autocast, eager and fused per
backend, against the same model trained in float64: 14 AdamW steps (lr 1e-4), 4 × 128 tokens. Asked by Pythia's fused
loss drifting from eager's on the H200 (docs/performance/NOTES-families.md).

    python benchmarks/probes/neox_trajectory.py reference mlir
    TRITON_INTERPRET=1 python benchmarks/probes/neox_trajectory.py triton     # the Triton kernels, interpreted (slow)
"""
import copy, sys, torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
import torchfuser
torch.manual_seed(0)
cfg = GPTNeoXConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, vocab_size=512,
                    rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu", attn_implementation="sdpa", tie_word_embeddings=False)
ref = GPTNeoXForCausalLM(cfg).train()
g = torch.Generator().manual_seed(1)
batches = [torch.randint(0, 512, (4, 128), generator=g) for _ in range(14)]
def traj(m, ac, dtype=torch.float32):
    m = m.to(dtype)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    out = []
    for ids in batches:
        with torch.autocast("cpu", torch.bfloat16, enabled=ac):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out
t64 = traj(copy.deepcopy(ref), False, torch.float64)
te = traj(copy.deepcopy(ref), True)
res = {"eager": te}
for b in sys.argv[1:]:
    res[b] = traj(torchfuser.optimize(copy.deepcopy(ref), backend=b), True)
for k, v in res.items():
    print(k, "max |Δ| vs fp64 over steps: %.4e  last %.4f (fp64 %.4f)" % (max(abs(a-b) for a, b in zip(v, t64)), v[-1], t64[-1]))
