"""The fused MoE block on a GPU: what torch._grouped_mm takes there, exactness of tiny models (fp32, bf16
autocast), host syncs and CUDA-graph capture of the fused block, and its forward + backward time at
issue 22's layer shapes against transformers' own experts (grouped_mm implementation).

    python3 benchmarks/probes/moe_probe.py --out moe-probe.jsonl
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torchfuser  # noqa: E402
from torchfuser.backends.reference import grouped_mm as gmm  # noqa: E402

rows = []
CAPTURE = "--no-capture" not in sys.argv


def emit(**row):
    rows.append(row)
    print(json.dumps(row), flush=True)


def grouped_mm_support():
    dev = "cuda"
    offs = torch.tensor([64, 64, 256], dtype=torch.int32, device=dev)  # the second group is empty
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(256, 128, device=dev, dtype=dt)
        w = torch.randn(3, 96, 128, device=dev, dtype=dt)
        got = {}
        try:
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            ref = torch.cat([x[:64] @ w[0].t(), x[64:] @ w[2].t()])
            got["rows"] = f"ok, max err {(y.float() - ref.float()).abs().max().item():.3g}"
        except Exception as err:
            got["rows"] = f"{type(err).__name__}: {str(err)[:120]}"
        try:
            dy = torch.randn(256, 96, device=dev, dtype=dt)
            dw = torch._grouped_mm(dy.t(), x, offs=offs)
            got["k"] = f"ok, empty group max {dw[1].float().abs().max().item():.3g}"
        except Exception as err:
            got["k"] = f"{type(err).__name__}: {str(err)[:120]}"
        emit(probe="grouped_mm", dtype=str(dt), **got)


def tiny_models():
    from transformers import AutoConfig, AutoModelForCausalLM

    from arch_sweep import tiny_config
    from test_moe import _DEEPSEEK

    for t in ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "qwen2_moe"):
        cfg = AutoConfig.for_model(t, **_DEEPSEEK) if t == "deepseek_v3" else tiny_config(t)
        cfg.router_aux_loss_coef = 0.3
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg).cuda().float().train()
        fused = torchfuser.optimize(copy.deepcopy(ref))
        ids = torch.randint(3, 128, (2, 12), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        out = {}
        for name, autocast in (("fp32", False), ("bf16-autocast", True)):
            losses, grads = [], []
            for m in (ref, fused):
                m.zero_grad(set_to_none=True)
                with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                    o = m(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
                o.loss.backward()
                losses.append(o.loss.item())
                grads.append([p.grad for p in m.parameters()])
            gerr = max(((a - b).abs().max() / (a.abs().max() + 1e-12)).item()
                       for a, b in zip(*grads) if a is not None)
            out[name] = dict(loss=losses, loss_diff=abs(losses[0] - losses[1]), grad_rel_err=gerr)
        rep = torchfuser.report(fused)
        emit(probe="tiny", model=t, moe=[e.backend for e in rep.entries if e.pattern == "moe"][:1],
             fallbacks=rep.fallbacks, **out)


def moe_block(model_type: str, e: int, k: int, inner: int, hidden: int = 2048):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hidden_size=hidden, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4,
                  vocab_size=1024, num_experts=e, num_experts_per_tok=k, norm_topk_prob=True)
    fields["moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"] = inner
    cfg = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg)
    return model.model.layers[0].mlp.train()


def timed(fn, steps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def blocks(tokens: int):
    for model_type, e, k, inner in (("qwen3_moe", 128, 8, 768), ("olmoe", 64, 8, 1024)):
        block = moe_block(model_type, e, k, inner)
        fused = torchfuser.optimize(nn.Sequential(copy.deepcopy(block)))[0]
        x = torch.randn(4, tokens // 4, 2048, device="cuda", requires_grad=True)
        dy = torch.randn(4, tokens // 4, 2048, device="cuda")
        res = {}
        for name, m in (("transformers", block), ("torchfuser", fused)):
            def step():
                with torch.autocast("cuda", torch.bfloat16):
                    y = m(x)
                y.backward(dy)
            try:
                res[name + "_ms"] = round(timed(step), 3)
            except Exception as err:
                res[name + "_ms"] = f"{type(err).__name__}: {str(err)[:200]}"
        # No host sync in the fused forward + backward (bf16 autocast: grouped GEMMs).
        try:
            torch.cuda.set_sync_debug_mode("error")
            with torch.autocast("cuda", torch.bfloat16):
                y = fused(x)
            y.backward(dy)
            res["host_sync"] = "none"
        except Exception as err:
            res["host_sync"] = f"{type(err).__name__}: {str(err)[:200]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        # CUDA-graph capture of the fused forward + backward, replayed against eager.
        try:
            if not CAPTURE:
                raise RuntimeError("capture not tried (--no-capture)")
            xs = torch.randn(4, tokens // 4, 2048, device="cuda", requires_grad=True)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            # autocast's weight-cast cache must be off inside a capture (PyTorch's CUDA-graph notes)
            with torch.cuda.stream(s):
                for _ in range(2):
                    with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
                        fused(xs).backward(dy)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            xs.grad = None
            with torch.cuda.graph(g):
                with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
                    yg = fused(xs)
                yg.backward(dy)
            xs.data.copy_(x.data)
            g.replay()
            torch.cuda.synchronize()
            with torch.autocast("cuda", torch.bfloat16):
                ye = fused(x.detach())
            res["graph_vs_eager"] = (yg.float() - ye.float()).abs().max().item()
        except Exception as err:
            res["graph_vs_eager"] = f"{type(err).__name__}: {str(err)[:200]}"
        emit(probe="block", model=model_type, tokens=tokens, experts=e, top_k=k, inner=inner, **res)
        del block, fused


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--parts", nargs="+", default=["grouped_mm", "tiny", "blocks"])
    p.add_argument("--no-capture", action="store_true")
    a = p.parse_args()
    emit(probe="env", torch=torch.__version__, gpu=torch.cuda.get_device_name(), cap=torch.cuda.get_device_capability())
    t0 = time.time()
    for part in a.parts:
        try:
            {"grouped_mm": grouped_mm_support, "tiny": tiny_models, "blocks": lambda: blocks(a.tokens)}[part]()
        except Exception as err:
            emit(probe=part, error=f"{type(err).__name__}: {err}"[:400])
    emit(probe="done", seconds=round(time.time() - t0, 1))
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
