"""Where the reference backend (no torch-mlir) wins or loses against eager PyTorch on the CPU.

    python benchmarks/probes/reference_cpu_probe.py blocks [--models demo qwen2 gpt2] [--amp]
    python benchmarks/probes/reference_cpu_probe.py step [--models demo] [--amp] [--reps 7]

``blocks``: each fused block kind alone (forward + backward of the fused module against the block it
replaced, on the inputs of a real training call), through ``torchfuser.autotune``'s own timer (fastest of
``--reps`` alternated runs). Blocks called by method (the residual-norm layer's norms) and the fused LM head
are not modules autotune times: ``step`` measures them. ``step``: whole training steps (forward, backward,
AdamW) of eager, every block fused on the reference backend, each kind left out in turn (``exclude``), and
``optimize`` as the default resolves it here (``--no-mlir``: as in a plain wheel's environment); alternated
round-robin, median and min of ``--reps``; ``--cpu-time``: the thread's CPU time (with one thread, the work of
the step without the waits for a core that a shared machine adds), not wall time.
A diagnostic for docs/performance/NOTES-mlir.md ("Without torch-mlir").
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchfuser  # noqa: E402
from torchfuser import autotune  # noqa: E402


CLOCK = time.perf_counter  # --cpu-time: time.thread_time (one thread: what the step computes, not the waits)


def build(name: str):
    import transformers as tr

    torch.manual_seed(0)
    if name == "demo":
        from torchfuser.demo import SIZES, build_model

        s = SIZES["cpu"]
        return build_model(s, 0), (s.batch, s.seq, s.vocab)
    if name == "qwen2":
        cfg = tr.Qwen2Config(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True)
        return tr.Qwen2ForCausalLM(cfg), (4, 128, 32000)
    if name == "gpt2":
        cfg = tr.GPT2Config(n_embd=256, n_layer=2, n_head=8, vocab_size=32000, n_positions=128)
        return tr.GPT2LMHeadModel(cfg), (4, 128, 32000)
    if name == "mixtral":
        cfg = tr.MixtralConfig(hidden_size=256, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                               num_key_value_heads=2, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2)
        return tr.MixtralForCausalLM(cfg), (4, 128, 32000)
    if name == "llama-tiny":
        cfg = tr.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128)
        return tr.LlamaForCausalLM(cfg), (2, 16, 128)
    raise ValueError(name)


def ids_for(shape, seed=1):
    b, s, v = shape
    return torch.randint(0, v, (b, s), generator=torch.Generator().manual_seed(seed))


def amp_ctx(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def blocks(models, amp: bool, reps: int) -> None:
    for name in models:
        model, shape = build(name)
        torchfuser.optimize(model, backend="reference")
        autotune.clear()
        autotune.apply(model, repeats=reps, margin=0.0)
        with amp_ctx(amp):
            model(input_ids=ids_for(shape), labels=ids_for(shape), use_cache=False).loss.backward()
        for d in autotune.decisions().values():
            print(f"{name:<10} {'bf16' if amp else 'fp32'}  {d.kind:<12} fused {d.fused_s * 1e3:8.2f} ms  "
                  f"original {d.original_s * 1e3:8.2f} ms  {d.speedup:.2f}×  ({d.where})", flush=True)


def step_fn(model, ids, amp):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        start = CLOCK()
        with amp_ctx(amp):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return CLOCK() - start
    return step


def step(models, amp: bool, reps: int, kinds) -> None:
    for name in models:
        base, shape = build(name)
        ids = ids_for(shape)
        variants = {"eager": base, "all (reference)": torchfuser.optimize(copy.deepcopy(base), backend="reference"),
                    "default": torchfuser.optimize(copy.deepcopy(base))}
        fused = {e.pattern for e in torchfuser.report(variants["all (reference)"]).fused}
        for k in kinds or sorted(fused):
            if k in fused:
                variants[f"only {k}"] = torchfuser.optimize(copy.deepcopy(base), backend="reference", patterns=[k])
        steps = {k: step_fn(m, ids, amp) for k, m in variants.items()}
        times = {k: [] for k in steps}
        order = list(steps)
        for k in order:
            steps[k]()  # warm-up
        for _ in range(reps):
            for k in order:
                times[k].append(steps[k]())
            order.reverse()
        eager = statistics.median(times["eager"])
        print(f"{name} {'bf16 autocast' if amp else 'fp32'}, load {os.getloadavg()[0]:.2f}; default: "
              f"{sorted({e.backend for e in torchfuser.report(variants['default']).fused})}")
        for k, t in times.items():
            med = statistics.median(t)
            print(f"  {k:<22} median {med * 1e3:8.1f} ms  min {min(t) * 1e3:8.1f} ms  {eager / med:.2f}× eager",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("blocks", "step"))
    p.add_argument("--models", nargs="+", default=["demo"])
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads (1: on a shared machine, parallel regions wait for busy cores)")
    p.add_argument("--kinds", nargs="*", default=None, help="step: the kinds fused alone (default: every one)")
    p.add_argument("--no-mlir", action="store_true", help="as if torch-mlir were not installed (CI's plain wheel)")
    p.add_argument("--cpu-time", action="store_true", help="step: the thread's CPU time, not wall time")
    a = p.parse_args()
    if a.no_mlir:
        from torchfuser import backends

        backends._INSTALLED["torch_mlir"] = False
    if a.cpu_time:
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(a.threads)
    (blocks if a.what == "blocks" else lambda m, amp, r: step(m, amp, r, a.kinds))(a.models, a.amp, a.reps)


if __name__ == "__main__":
    main()
