"""Whether a fused MoE block's forward + backward can be captured in a CUDA graph, and if not, where:
a tiny Qwen3-MoE layer's FusedMoE on the GPU, each backend × autocast on/off. First the step runs
once under ``torch.cuda.set_sync_debug_mode("error")`` (a host sync raises, with its Python stack),
then it is captured and replayed; "ok" or the first lines of the error per case.

    python3 benchmarks/probes/moe_block_capture_probe.py
"""
import sys
import traceback

import torch

sys.path.insert(0, ".")
import torchfuser  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

cfg = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=512, norm_topk_prob=True)


def case(backend, autocast):
    torch.manual_seed(0)
    model = torchfuser.optimize(Qwen3MoeForCausalLM(cfg).cuda(), backend=backend)
    block = model.model.layers[0].mlp
    x = torch.randn(2, 128, 256, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = block(x)
        y.float().sum().backward()

    where = f"{backend:9s} autocast={autocast!s:5s}"
    try:
        torch.cuda.set_sync_debug_mode("error")
        step()
    except Exception:
        print(where, "host sync:", "".join(traceback.format_exc().splitlines(True)[-12:]), flush=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        print(where, "capture ok", flush=True)
    except Exception:
        print(where, "capture FAIL:", "".join(traceback.format_exc().splitlines(True)[-14:]), flush=True)
        torch.cuda.synchronize()
    print(where, torchfuser.report(model).notes, flush=True)


for backend in ("triton", "reference"):
    for autocast in (True, False):
        case(backend, autocast)
