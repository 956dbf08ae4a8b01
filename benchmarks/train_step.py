"""Whole training steps (forward, backward, AdamW) of recipe models, variant by variant.

    python benchmarks/train_step.py --models llama1b qwen05b --out benchmarks/results/archive/train-step.jsonl
    python benchmarks/train_step.py --models tiny --device cpu --batch 2 --seq 64 --steps 3   # smoke run

Variants: eager, compile (torch.compile), torchfuser, torchfuser-graphs (optimize(model,
cuda_graphs=True)), torchfuser-nographs (cuda_graphs=False), torchfuser-offload and torchfuser-recompute (optimize(model, checkpointing="offload" / True):
each fused decoder layer keeps only its input, on the host / on the device, and runs again in the backward), torchfuser-fp8[-tensorwise|-blockwise][-pair|-rt][-head][-per-step][-graphs|+compile] (optimize(model,
fp8="rowwise", "tensorwise" or "blockwise"; pair / rt: rowwise both-ways quantisation by the two separate
kernels / by the rows kernel writing column partials and the tiles kernel; head:
fp8_lm_head=True; per-step: fp8_weights="per_step"; noprod: no quantisation in the producers; FP8_VARIANTS lists them), torchao-fp8+compile, torchao-fp8-rowwise+compile and
torchfuser+torchao-fp8+compile (torchao's float8 training, tensorwise or rowwise, when installed), torchfuser+compile, torchfuser+compile-ew (the same, traced with
TORCHFUSER_COMPILED_ELEMENTWISE set to --compiled-elementwise, default "inductor"),
compile-torchfuser (torch.compile(backend="torchfuser")), torchfuser+compile-torchfuser (both),
compile-cudagraphs and torchfuser+compile-cudagraphs (torch.compile(..., mode="reduce-overhead"):
Inductor's CUDA graphs), liger (Liger-Kernel, when installed; it patches transformers classes
globally, so it runs last for each model), unsloth and unsloth-offload (Unsloth's FastLanguageModel
with LoRA, without and with its offloaded checkpointing, each in a process of its own, with the first
step's loss against PEFT's: benchmarks/unsloth_variant.py). Each variant builds the model
afresh from the same seed, trains on the same random tokens under bf16 autocast (CUDA) with fp32
parameters (``--precision bf16``: bf16 parameters and no autocast, as ``model.to(torch.bfloat16)``
training runs), and reports ms/step (median of the timed steps), tokens/s, peak memory and the
first/last loss: one JSON line per variant, then a table with ratios against eager and compile.

Workloads (``--workload``, benchmarks/workloads.py): fixed-shape batches (default), padded batches
whose length changes every step (``varying``), padding-free packed rows (``packed``) and the same
samples padded (``padded-samples``); tokens/s counts real tokens. ``--lora R`` trains PEFT LoRA
adapters of rank R on every attention and MLP projection instead of the whole model (with
``--precision bf16``: frozen bf16 weights, as LoRA fine-tuning runs).

    python benchmarks/train_step.py --models llama8b --precision bf16 --lora 16 --variants eager torchfuser
    python benchmarks/train_step.py --models llama8b --precision bf16 --lora 16 --quant nf4 --variants eager torchfuser unsloth

``--quant nf4|fp4|int8`` (with ``--lora R``): QLoRA, the adapters on a bitsandbytes base (benchmarks/qlora.py).
    python benchmarks/train_step.py --models qwen05b --workload varying --variants eager torchfuser torchfuser-graphs
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torchfuser  # noqa: E402
import ladder  # noqa: E402
import qlora  # noqa: E402
import unsloth_variant  # noqa: E402
import workloads  # noqa: E402
from profiling import copies_by_shape, gpu_idle, host_profile, profiled, write_tables  # noqa: E402

# TorchFuser's FP8 variants: "torchfuser-fp8", then any of these options in this order, then "-graphs" or
# "+compile": tensorwise or blockwise (the recipe; else rowwise), pair or rt (rowwise both-ways
# quantisation by the two separate kernels, or by the rows kernel writing column partials + the tiles
# kernel), head (fp8_lm_head=True), per-step (fp8_weights="per_step"), noprod (no producer of ours hands
# its output's maxima on: every operand quantised by the separate passes, as before the producers).
FP8_OPTIONS = ("tensorwise", "blockwise", "pair", "rt", "head", "per-step", "noprod")
FP8_VARIANTS = tuple("-".join(("torchfuser-fp8", *opts)) + end
                     for opts in ((), *((o,) for o in FP8_OPTIONS), ("head", "per-step"), ("tensorwise", "head"),
                                  ("blockwise", "per-step"))
                     for end in ("", "-graphs", "+compile"))
VARIANTS = ("eager", "compile", "torchfuser", "torchfuser-auto", "torchfuser-graphs", "torchfuser-nographs", "torchfuser-offload", "torchfuser-recompute",
            "torchfuser+compile", "torchfuser+compile-ew",
            "compile-torchfuser", "torchfuser+compile-torchfuser", "compile-cudagraphs", "torchfuser+compile-cudagraphs",
            *FP8_VARIANTS, "torchao-fp8+compile", "torchao-fp8-rowwise+compile", "torchfuser+torchao-fp8+compile",
            "liger", *unsloth_variant.VARIANTS)


def build(recipe: str, device: torch.device, seed: int, dtype: torch.dtype = torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((ROOT / "recipes" / f"{recipe}.json").read_text())
    impl = fields.pop("attn_implementation", "sdpa")  # a recipe may name another: BLOOM and MPT have no SDPA path
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg._attn_implementation = impl
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(cfg)
    return model.to(dtype).train()


def _torchao_float8(model, recipe: str):
    """torchao's float8 training (torchtitan's recipe) on every projection but the LM head, in place."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: "lm_head" not in name)


def _rowwise_both(path: str | None) -> None:
    """fp8_quantize_both's rowwise path for the variants to come (None: the default): the -pair variants
    run the two separate kernels, to compare whole steps with the default's."""
    from torchfuser.switches import SWITCHES

    _DEFAULT_BOTH.setdefault("path", SWITCHES.fp8_rowwise_both)
    SWITCHES.fp8_rowwise_both = path or _DEFAULT_BOTH["path"]


_DEFAULT_BOTH: dict = {}


def _fp8_options(variant: str) -> tuple[set, str] | None:
    """(options, ending) of one of FP8_VARIANTS, else None."""
    if not variant.startswith("torchfuser-fp8"):
        return None
    end = "+compile" if variant.endswith("+compile") else "-graphs" if variant.endswith("-graphs") else ""
    rest = variant[len("torchfuser-fp8"):len(variant) - len(end)]
    return {o for o in FP8_OPTIONS if f"-{o}" in rest}, end


def prepare(variant: str, model, backend: str = "auto", compiled_elementwise: str = "inductor", exclude=()):
    """The callable a step runs, for one variant (the torchfuser ones without the patterns ``exclude``)."""
    optimize = functools.partial(torchfuser.optimize, exclude=exclude)
    fp8 = _fp8_options(variant)
    _rowwise_both(None if not fp8 else "pair" if "pair" in fp8[0] else "rows+tiles" if "rt" in fp8[0] else None)
    if fp8 is not None:
        opts, end = fp8
        from torchfuser.switches import SWITCHES

        SWITCHES.fp8_producers = "noprod" not in opts
        recipe = next((r for r in ("tensorwise", "blockwise") if r in opts), "rowwise")
        fused = optimize(model, backend=backend, fp8=recipe,
                         cuda_graphs=end == "-graphs", **({"fp8_lm_head": True} if "head" in opts else {}),
                         **({"fp8_weights": "per_step"} if "per-step" in opts else {}))
        return torch.compile(fused) if end == "+compile" else fused
    if variant == "eager" or variant in unsloth_variant.VARIANTS:  # Unsloth's model comes patched from its loader
        return model
    if variant == "compile":
        return torch.compile(model)
    if variant == "torchfuser":
        return optimize(model, backend=backend)
    if variant in ("torchfuser-graphs", "torchfuser-auto", "torchfuser-nographs"):
        graphs = {"torchfuser-graphs": True, "torchfuser-auto": "auto", "torchfuser-nographs": False}[variant]
        return optimize(model, backend=backend, cuda_graphs=graphs)
    if variant in ("torchfuser-offload", "torchfuser-recompute"):  # each fused layer keeps its input (on the host)
        return optimize(model, backend=backend, checkpointing="offload" if variant.endswith("offload") else True)
    if variant.startswith(("torchao-fp8", "torchfuser+torchao-fp8")):
        _torchao_float8(model, "rowwise" if "rowwise" in variant else "tensorwise")
        return torch.compile(optimize(model, backend=backend) if variant.startswith("torchfuser") else model)
    if variant == "torchfuser+compile":
        return torch.compile(optimize(model, backend=backend))
    if variant == "torchfuser+compile-ew":
        compiled = torch.compile(optimize(model, backend=backend))

        def traced_with_inductor_elementwise(**kwargs):
            with mock.patch.dict(os.environ, {"TORCHFUSER_COMPILED_ELEMENTWISE": compiled_elementwise}):
                return compiled(**kwargs)

        return traced_with_inductor_elementwise
    if variant == "compile-torchfuser":
        return torch.compile(model, backend="torchfuser")
    if variant.endswith("compile-cudagraphs"):
        target = optimize(model, backend=backend) if variant.startswith("torchfuser") else model
        compiled = torch.compile(target, mode="reduce-overhead")

        def replayed(**kwargs):
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are consumed: reuse them
            return compiled(**kwargs)

        return replayed
    if variant == "torchfuser+compile-torchfuser":
        return torch.compile(optimize(model, backend=backend), backend="torchfuser")
    if variant == "liger":
        import liger_kernel.transformers as liger

        apply = getattr(liger, f"apply_liger_kernel_to_{model.config.model_type}")
        apply(model=model)
        return model
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")


def liger_missing(recipe: str) -> str | None:
    """Why the liger variant cannot run on ``recipe``'s model type (not installed, or no patch for it), or None."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return "liger-kernel is not installed"
    model_type = json.loads((ROOT / "recipes" / f"{recipe}.json").read_text())["model_type"]
    if not hasattr(liger, f"apply_liger_kernel_to_{model_type}"):
        return f"Liger-Kernel has no patch for {model_type}"
    return None


def run_variant(recipe, variant, args, device):
    from torchfuser.compiler import inductor_pass

    bf16_params = args.precision == "bf16"
    unsloth = variant in unsloth_variant.VARIANTS  # in its worker process (unsloth_variant.run_isolated)
    if unsloth:
        model = unsloth_variant.load(variant, args)
    elif getattr(args, "quant", None):  # QLoRA: the recipe's weights quantised by bitsandbytes (benchmarks/qlora.py)
        model = qlora.load(recipe, args, device, build, torch.bfloat16 if bf16_params else torch.float32)
    else:
        model = build(recipe, device, args.seed, torch.bfloat16 if bf16_params else torch.float32)
    if args.lora and not unsloth:
        model = workloads.add_lora(model, args.lora, args.seed)
    if args.grad_checkpointing and not unsloth:  # HF's, non-reentrant, on every decoder layer (before optimize, as users do)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    passes_before = len(inductor_pass.RECENT)
    step_fn = prepare(variant, model, args.backend, args.compiled_elementwise, args.exclude)
    if args.exclude and "torchfuser" in variant:
        variant = f"{variant}-no-{'-'.join(args.exclude)}"
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4, fused=device.type == "cuda")
    batches = run_batches(args, model.config.vocab_size, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda" and not bf16_params)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, times, tokens = [], [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # The warm-up's peaks (cuda_graphs="auto" times and captures there) apart from the timed steps'. Reserved beside
    # allocated: a CUDA graph's pool is reserved, not allocated, once captured (replays allocate nothing), so for
    # graph variants the reserved peak is the footprint; for the others it adds the caching allocator's slack.
    warm_peak = warm_reserved = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup and device.type == "cuda":
            warm_peak = torch.cuda.max_memory_allocated(device) / 2**30
            warm_reserved = torch.cuda.max_memory_reserved(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        inputs = dict(batches[step % len(batches)])
        real = inputs.pop("tokens")
        sync()
        start = time.perf_counter()
        losses.append(ladder.one_step(step_fn, opt, inputs, autocast))
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            tokens.append(real)
    timed_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    peak = None if timed_peak is None else max(warm_peak, timed_peak)
    reserved = max(warm_reserved, torch.cuda.max_memory_reserved(device) / 2**30) if device.type == "cuda" else None
    if getattr(args, "ladder", None):  # context_length.py: longer rows on the same model
        climbed = ladder.climb(step_fn, opt, model.config.vocab_size, args, device, autocast, sync, times[-1])
    if args.profile_dir:
        inputs = {k: v for k, v in batches[0].items() if k != "tokens"}
        name = f"{recipe}-{variant.replace('+', '_')}.txt"
        profile(step_fn, opt, inputs, autocast, device, Path(args.profile_dir) / f"profile-{name}")
        if getattr(args, "host_profile", False):
            host = host_profile(functools.partial(ladder.one_step, step_fn, opt, inputs, autocast), 3)
            (Path(args.profile_dir) / f"host-{name}").write_text(host)
    ms = statistics.median(times) * 1e3
    row = {
        "model": recipe, "variant": variant, "precision": args.precision, "workload": args.workload, "lora": args.lora,
        "quant": getattr(args, "quant", None),
        "grad_checkpointing": unsloth_variant.CHECKPOINTING[variant] if unsloth else args.grad_checkpointing,
        "ms_per_step": round(ms, 2), "tokens_per_s": round(sum(tokens) / sum(times)),  # real tokens
        "trained_parameters": sum(p.numel() for p in trained), "peak_gib": None if peak is None else round(peak, 2),
        "peak_gib_timed": None if timed_peak is None else round(timed_peak, 2),
        "peak_reserved_gib": None if reserved is None else round(reserved, 2),
        "first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4), "losses": [round(v, 5) for v in losses],
        "step_ms": [round(t * 1e3, 2) for t in times], "step_tokens": tokens,
        "fused_blocks": len(torchfuser.report(model).fused),
        "report_notes": torchfuser.report(model).notes,  # graph captures and replays, call-time fallbacks, adapters
    }
    if getattr(args, "ladder", None):
        row["ladder"] = climbed
    # What optimize's Inductor pass did to the compiled graphs (torch.compile(optimize(model))).
    passes = [line for r in inductor_pass.RECENT[passes_before:] for line in r.rewrites + r.skipped]
    if passes:
        row["inductor_pass"] = passes
    if variant.endswith("-ew"):
        row["compiled_elementwise"] = args.compiled_elementwise
    if unsloth:  # unsloth_variant.run_isolated adds PEFT's losses of the same first step
        row["loss_first_step"] = {"unsloth": losses[0]}
    del model, step_fn, opt
    return row


def run_batches(args, vocab: int, device) -> list[dict]:
    """The run's batches: a new length every step for `varying`; the others cycle through a few."""
    n = args.warmup + args.steps if args.workload == "varying" else 4
    return workloads.batches(args.workload, n, vocab, args.batch, args.seq, args.seed, device)


def run_unsloth(recipe, variant, args, device):
    """An unsloth variant's row, from a process of its own (Unsloth patches transformers and PEFT
    globally), or the reason it is skipped."""
    from transformers import AutoConfig

    fields = json.loads((ROOT / "recipes" / f"{recipe}.json").read_text())
    reason = unsloth_variant.skip_reason(AutoConfig.for_model(fields.pop("model_type"), **fields), args, device)
    if reason:
        print(f"{recipe} {variant}: skipped: {reason}", flush=True)
        return {"model": recipe, "variant": variant, "skipped": reason}
    return unsloth_variant.run_isolated(recipe, variant, args, device, build, run_batches)


def profile(step_fn, opt, inputs, autocast, device, path):
    """Two steps under the profiler: the kernels and ops that take the time, for the notes."""
    prof = profiled(lambda: ladder.one_step(step_fn, opt, inputs, autocast), device, 2, record_shapes=True)
    cuda = device.type == "cuda"
    write_tables(prof, path, ("self_cuda_time_total" if cuda else "self_cpu_time_total",), 90, 200,
                 (gpu_idle(prof) if cuda else "") + copies_by_shape(prof))


def environment(device):
    import transformers

    env = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        import triton

        env["triton"] = triton.__version__
    from importlib.metadata import PackageNotFoundError, version

    for name in ("liger-kernel", "unsloth", "unsloth_zoo"):  # the peers, when installed (not imported here)
        try:
            env[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            pass
    return env


def table(rows):
    lines = [f"{'model':10} {'variant':30} {'ms/step':>9} {'tok/s':>9} {'peak GiB':>9} {'reserved':>9} {'vs eager':>9} {'vs compile':>10} {'loss first→last':>18}"]
    for r in rows:
        if "error" in r or "skipped" in r:
            what = f"failed: {r['error'][:80]}" if "error" in r else f"skipped: {r['skipped'][:80]}"
            lines.append(f"{r['model']:10} {r['variant']:30} {what}")
            continue
        base = {v: x for x in rows if x["model"] == r["model"] and "ms_per_step" in x for v in [x["variant"]]}
        ratio = lambda v: f"{base[v]['ms_per_step'] / r['ms_per_step']:.2f}×" if v in base else "-"
        peak, held = (("-" if r.get(k) is None else f"{r[k]:.1f}") for k in ("peak_gib", "peak_reserved_gib"))
        lines.append(f"{r['model']:10} {r['variant']:30} {r['ms_per_step']:9.1f} {r['tokens_per_s']:9,d} {peak:>9} {held:>9} "
                     f"{ratio('eager'):>9} {ratio('compile'):>10} {r['first_loss']:8.3f}→{r['last_loss']:<8.3f}")
        # unsloth variants: the first step's loss against PEFT's, same weights and batch (none in a ladder run)
        if "loss_parity" in r and r["loss_first_step"].get("peft_eager_bf16") is not None:
            f, p = r["loss_first_step"], r["loss_parity"]
            verdict = {True: "within", False: "NOT within", None: "no fp32 reference for"}[p["within_rule"]]
            lines.append(f"{'':41} first-step loss {f['unsloth']:.4f}, PEFT {f['peft_eager_bf16']:.4f}, fp32 "
                         f"{f['reference_fp32'] or float('nan'):.4f}: {verdict} the bf16 rule")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama1b", "qwen05b"])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048, help="tokens a row (varying: the longest; packed: the longest sample)")
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="fixed")
    parser.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R only")
    parser.add_argument("--quant", choices=qlora.QUANTS, help="QLoRA: LoRA (--lora R) on a bitsandbytes base "
                        "(benchmarks/qlora.py); the unsloth variants load it with load_in_4bit / load_in_8bit")
    parser.add_argument("--grad-checkpointing", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", choices=("autocast", "bf16"), default="autocast",
                        help="fp32 parameters under bf16 autocast, or bf16 parameters without autocast")
    parser.add_argument("--backend", default="auto", help="torchfuser backend for the torchfuser variants")
    parser.add_argument("--compiled-elementwise", default="inductor",
                        help="TORCHFUSER_COMPILED_ELEMENTWISE for the torchfuser+compile-ew variant")
    parser.add_argument("--exclude", nargs="*", default=[], help="patterns the torchfuser variants leave out (an A/B)")
    parser.add_argument("--ladder", nargs="*", type=int, default=[], metavar="SEQ",
                        help="then one step at each of these longer lengths, until out of memory (benchmarks/ladder.py)")
    parser.add_argument("--ladder-budget", type=float, default=0, help="seconds the ladder may take (0: no limit)")
    parser.add_argument("--out", help="append JSON lines here")
    parser.add_argument("--profile-dir", help="write a profiler table per variant here")
    parser.add_argument("--host-profile", action="store_true",
                        help="with --profile-dir: also where the host's Python time goes (cProfile, host-*.txt)")
    args = parser.parse_args(argv)
    if args.quant and not args.lora:
        parser.error("--quant trains LoRA adapters on the quantised base: pass --lora R too")
    device = torch.device(args.device)
    env = environment(device)
    print(json.dumps({"environment": env}), flush=True)
    rows = []
    for recipe in args.models:
        for variant in sorted(args.variants, key=lambda v: v == "liger"):
            try:
                if variant == "liger" and (why := liger_missing(recipe)):
                    print(f"{recipe} {variant}: skipped: {why}", flush=True)
                    row = {"model": recipe, "variant": variant, "skipped": why}
                elif variant in unsloth_variant.VARIANTS:
                    row = run_unsloth(recipe, variant, args, device)
                else:
                    row = run_variant(recipe, variant, args, device)
            except Exception as err:  # one failing variant must not hide the others' numbers
                traceback.print_exc()
                row = {"model": recipe, "variant": variant, "error": f"{type(err).__name__}: {err}"}
            row.update(batch=args.batch, seq=args.seq, **env)
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    unsloth_variant.cleanup()
    print(table(rows))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
