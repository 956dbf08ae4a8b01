"""ATen calls of one LoRA training step on the CPU, fused against PEFT's unfused model, and per fused LoRA
node (``modules.adapters.lora._LoRALinear``: forward with ``joint``'s glue, and backward), by op name.

A tiny Llama (2 layers, hidden 64), PEFT LoRA r=8 on all seven projections, one step (forward, backward),
fp32 or a bf16 base (fp32 adapters, the hi/lo split path); counted with torch.profiler (every ``aten::`` event,
nested ones included, as the issue counted; "top" counts those not inside another aten op). Counts are
deterministic: no timing here.

    PYTHONPATH=. python benchmarks/probes/lora_aten_calls.py [--dtype bf16] [--by-op]
"""
from __future__ import annotations

import argparse
import collections
import copy

import peft
import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules.adapters import lora

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model(dtype):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).to(dtype)
    return peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL, lora_dropout=0.0,
                                                     init_lora_weights=False))


class _Marked:
    """joint() and _LoRALinear.backward inside record_function ranges, for the per-node count."""

    def __enter__(self):
        self.joint, self.backward = lora.joint, lora._LoRALinear.backward
        real_joint, real_backward = self.joint, self.backward

        def joint(*a, **k):
            with record_function("lora_node_fwd"):
                return real_joint(*a, **k)

        def backward(ctx, dy):
            with record_function("lora_node_bwd"):
                return real_backward(ctx, dy)

        lora.joint, lora._LoRALinear.backward = joint, staticmethod(backward)
        import torchfuser.modules.attention as att
        import torchfuser.modules.mlp as mlp
        self.patched = [m for m in (att, mlp) if getattr(m, "lora", None) is lora]
        return self

    def __exit__(self, *exc):
        lora.joint, lora._LoRALinear.backward = self.joint, staticmethod(self.backward)


def _aten(events):
    return [e for e in events if e.name.startswith("aten::")]


def count(m, ids, marked=False):
    """(all aten events, top-level aten events, {node range: (calls of it, aten events inside, by op)})."""
    m.zero_grad(set_to_none=True)
    ctx = _Marked() if marked else None
    if ctx:
        ctx.__enter__()
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            m(input_ids=ids, labels=ids).loss.backward()
    finally:
        if ctx:
            ctx.__exit__()
    events = prof.events()
    aten = _aten(events)
    top = [e for e in aten if e.cpu_parent is None or not _inside_aten(e)]
    nodes = {}
    for name in ("lora_node_fwd", "lora_node_bwd"):
        ranges = [e for e in events if e.name == name]
        inside = [c for r in ranges for c in _descendants(r) if c.name.startswith("aten::")]
        top_inside = [c for c in inside if not _inside_aten(c)]
        nodes[name] = (len(ranges), len(inside), len(top_inside), collections.Counter(c.name for c in top_inside))
    return len(aten), len(top), nodes, collections.Counter(e.name for e in aten)


def _inside_aten(e):
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def _descendants(e):
    for c in e.cpu_children:
        yield c
        yield from _descendants(c)


def python_calls(m, ids) -> int:
    """Python function calls (cProfile's count, builtins included) of one training step."""
    import cProfile
    import pstats

    m.zero_grad(set_to_none=True)
    prof = cProfile.Profile()
    prof.enable()
    m(input_ids=ids, labels=ids).loss.backward()
    prof.disable()
    return pstats.Stats(prof).total_calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--by-op", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    ref = model(dtype)
    fused = torchfuser.optimize(copy.deepcopy(ref))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for m in (ref, fused):  # warm: lazy inits, the MLIR kernels' compilation
        m(input_ids=ids, labels=ids).loss.backward()
    a_ref, t_ref, _, ops_ref = count(ref, ids)
    a_f, t_f, _, ops_f = count(fused, ids)
    _, _, nodes, _ = count(fused, ids, marked=True)
    print(f"{args.dtype}: one LoRA step, aten events (nested included) / top-level")
    print(f"  unfused PEFT: {a_ref} / {t_ref}")
    print(f"  fused:        {a_f} / {t_f}   ({a_f / a_ref:.2f}× / {t_f / t_ref:.2f}×)")
    print(f"  Python calls a step: unfused {python_calls(ref, ids)}, fused {python_calls(fused, ids)}")
    for name, (calls, inside, top, by_op) in nodes.items():
        print(f"  {name}: {calls} calls, {inside} aten events ({inside / max(calls, 1):.1f} a call), "
              f"{top} top-level ({top / max(calls, 1):.1f} a call; by op below)")
        if args.by_op:
            for op, n in by_op.most_common(20):
                print(f"      {op:<32} {n / max(calls, 1):5.1f} per call")
    if args.by_op:
        print("  whole step, fused minus unfused, by op:")
        for op in sorted(set(ops_f) | set(ops_ref), key=lambda o: -(ops_f[o] - ops_ref[o]))[:15]:
            print(f"      {op:<32} {ops_f[op]:5d} {ops_ref[op]:5d}")


if __name__ == "__main__":
    main()
