"""Packed (padding-free) attention on the GPU: what the installed PyTorch's variable-length attention
(``torch.nn.attention.varlen``) takes, whether it equals per-sample SDPA forward and backward, and how
fast it is against SDPA with the dense block-diagonal mask transformers builds for packed rows.

    python benchmarks/probes/varlen_probe.py [--out probe.jsonl]

A diagnostic for the packed-sequence path of the fused attention (issue 21), not a target check.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import workloads  # noqa: E402


def lengths_of(pos: torch.Tensor) -> list[int]:
    starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
    return [b - a for a, b in zip(starts, starts[1:])]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    try:
        from torch.nn.attention import varlen
        sig = str(inspect.signature(varlen.varlen_attn))
    except Exception as err:  # not in this PyTorch
        emit({"varlen": None, "error": repr(err), "torch": torch.__version__})
        varlen = None
    else:
        emit({"varlen_attn": sig, "torch": torch.__version__, "device": torch.cuda.get_device_name()})
    pos = workloads.batches("packed", 1, 100, 1, 2048, 0, "cpu")[0]["position_ids"][0]
    lens = lengths_of(pos)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).cuda()
    total = pos.numel()
    causal = torch.ones(total, total, dtype=torch.bool, device="cuda").tril()
    block = causal & (seg[:, None] == seg[None, :])
    for hq, hk, d in ((14, 2, 64), (32, 8, 64), (32, 8, 128)):
        q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, hk, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)

        def dense():
            qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
            return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=block, enable_gqa=True)[0].transpose(0, 1)

        def per_sample():
            outs = []
            for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
                qb, kb, vb = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
            return torch.cat(outs)

        forms = {"sdpa_block_mask": dense, "sdpa_per_sample": per_sample}
        if varlen is not None:
            params = inspect.signature(varlen.varlen_attn).parameters
            kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            longest = max(lens)
            forms["varlen_attn"] = lambda: varlen.varlen_attn(q, k, v, cu, cu, longest, longest, **kw)
        ref = None
        for name, fn in forms.items():
            row = {"heads": hq, "kv_heads": hk, "head_dim": d, "tokens": total, "samples": len(lens), "form": name}
            try:
                out = fn()
                grads = torch.autograd.grad(out, (q, k, v), dout)
                if ref is None:
                    ref = (out, grads)
                else:
                    row["max_diff_out"] = float((out - ref[0]).abs().max())
                    row["max_diff_grads"] = [float((g - r).abs().max()) for g, r in zip(grads, ref[1])]
                row["fwd_ms"] = round(do_bench(fn, rep=50), 4)
                row["fwd_bwd_ms"] = round(do_bench(lambda: torch.autograd.grad(fn(), (q, k, v), dout), rep=50), 4)
            except Exception as err:  # a form this PyTorch cannot run: note it, go on
                row["error"] = repr(err)[:300]
            emit(row)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
