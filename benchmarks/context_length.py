"""The longest context that trains on one GPU (issue 37): batch 1, LoRA r=16 on all seven projections of
llama8b's shape (bf16 base, or ``--quant nf4``: QLoRA), for each setting:

    peft-hf-ckpt        PEFT + HF gradient checkpointing (non-reentrant)       train_step eager --grad-checkpointing
    unsloth-offload     Unsloth with its offloaded gradient checkpointing     train_step unsloth-offload
    torchfuser-offload  TorchFuser's best: the fused LM head + loss (the        train_step torchfuser-offload
                        logits never built), each fused layer's input kept on the host (checkpointing="offload")
    torchfuser          TorchFuser's default path with HF checkpointing         train_step torchfuser --grad-checkpointing
                        (not run unless named)

Each setting is one ``train_step.py --ladder`` process (benchmarks/ladder.py): the model is built once, a warm-up
and a timed step at ``--start`` tokens, then one step at each longer length (steps of ``--step``) until out of
memory or until the next step would pass ``--budget`` seconds. Long steps are slow (attention's cost grows with
the square of the length: an 8B step at 256k tokens takes minutes), so a setting that does not reach its limit
within the budget gets a prediction instead: peak memory is linear in the length for all of these settings
(checkpoints, activations of one layer, chunked or offloaded losses), so a least-squares line through the
measured peaks gives the bytes a token, and the longest multiple of ``--step`` whose predicted peak fits the
device's memory less ``--margin-gib``. The table says which lengths were measured and which are predicted; a
plot (``--plot``) shows the points, the lines and the device's memory.

All settings run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (Unsloth sets it itself).

    python benchmarks/context_length.py --quant nf4 --out context-length-qlora.jsonl --plot context-qlora.png
    python benchmarks/context_length.py --quant nf4 --settings torchfuser-offload --lengths 278528 --budget 0  # confirm
    python benchmarks/context_length.py --model tiny --device cpu --start 64 --step 64 --max 192   # smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {
    "peft-hf-ckpt": ["--variants", "eager", "--grad-checkpointing"],
    "unsloth-offload": ["--variants", "unsloth-offload"],
    "torchfuser-offload": ["--variants", "torchfuser-offload"],
    "torchfuser": ["--variants", "torchfuser", "--grad-checkpointing"],
}
DEFAULT_SETTINGS = ["peft-hf-ckpt", "unsloth-offload", "torchfuser-offload"]
_OOM = ("OutOfMemory", "out of memory", "CUDA error: out of memory")


def run_setting(setting: str, args) -> dict:
    """One setting's ladder: {"setting", "points": [...], "total_gib", ...} (points: seq, status, ms, tokens/s, peak)."""
    ladder = args.lengths or list(range(args.start + args.step, args.max + 1, args.step))
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
        cmd = [sys.executable, str(HERE / "train_step.py"), "--models", args.model, "--device", args.device,
               "--precision", "bf16", "--lora", "16", "--batch", "1", "--seq", str(args.start), "--steps", "1",
               "--warmup", "1", "--ladder", *map(str, ladder), "--ladder-budget", str(args.budget), "--out", out.name,
               *(["--quant", args.quant] if args.quant else []), *SETTINGS[setting]]
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            return {"setting": setting, "points": [], "error": f"no result in {args.timeout:.0f} s"}
        rows = [json.loads(line) for line in Path(out.name).read_text().splitlines() if line.strip()]
    row = rows[-1] if rows else {"error": f"no result (exit {proc.returncode}): {tail[-400:]}"}
    if "ms_per_step" not in row:  # the first length failed
        text = json.dumps(row) + ("" if rows else tail)
        status = "oom" if any(s in text for s in _OOM) else "skipped" if "skipped" in row else "error"
        why = (row.get("error") or row.get("skipped") or "")[:300]
        return {"setting": setting, "points": [{"seq": args.start, "status": status, "why": why}]}
    first = {"seq": args.start, "status": "ok", **{k: row[k] for k in ("ms_per_step", "tokens_per_s", "peak_gib")}}
    climbed = row.get("ladder", {})
    return {"setting": setting, "quant": args.quant, "model": args.model, "fused_blocks": row.get("fused_blocks"),
            "points": [first, *climbed.get("points", [])], "total_gib": climbed.get("total_gib"),
            **{k: row.get(k) for k in ("gpu", "torch", "transformers", "triton", "unsloth", "date")}}


def fit(points: list[dict]) -> tuple[float, float] | None:
    """Least-squares (GiB at zero length, GiB a token) through the measured peaks; None under two points."""
    xy = [(p["seq"], p["peak_gib"]) for p in points if p["status"] == "ok" and p.get("peak_gib") is not None]
    if len(xy) < 2:
        return None
    n, sx, sy = len(xy), sum(x for x, _ in xy), sum(y for _, y in xy)
    sxx, sxy = sum(x * x for x, _ in xy), sum(x * y for x, y in xy)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return (sy - slope * sx) / n, slope


def summarise(result: dict, args) -> dict:
    """The longest measured length, what ended the ladder, and (unless out of memory ended it) the prediction."""
    points = result["points"]
    ok = [p for p in points if p["status"] == "ok"]
    ended = points[-1]["status"] if points and points[-1]["status"] != "ok" else "max"
    line = fit(points)
    summary = {"longest_measured": ok[-1]["seq"] if ok else 0, "ended_by": ended,
               "tokens_per_s_there": ok[-1]["tokens_per_s"] if ok else None}
    if line and result.get("total_gib"):
        base, per_token = line
        fits = (result["total_gib"] - args.margin_gib - base) / per_token
        summary.update(gib_at_zero=round(base, 2), kib_per_token=round(per_token * 2**20, 1),
                       predicted_longest=int(fits // args.step * args.step),
                       worst_residual_gib=round(max(abs(base + per_token * p["seq"] - p["peak_gib"]) for p in ok), 3))
    if ended == "oom":  # measured: the prediction only checks the line
        summary["longest"], summary["how"] = summary["longest_measured"], "measured (next length out of memory)"
    elif "predicted_longest" in summary:
        summary["longest"], summary["how"] = summary["predicted_longest"], f"predicted (ladder ended by {ended})"
    else:
        summary["longest"], summary["how"] = summary["longest_measured"], f"measured, ended by {ended}"
    return summary


def plot(results: list[dict], args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    top = 0
    for r in results:
        ok = [p for p in r["points"] if p["status"] == "ok"]
        if not ok:
            continue
        dots = ax.plot([p["seq"] / 1024 for p in ok], [p["peak_gib"] for p in ok], "o", label=r["setting"])[0]
        s = r["summary"]
        if "kib_per_token" in s:
            end = max(s["predicted_longest"], ok[-1]["seq"]) + args.step
            top = max(top, end)
            ax.plot([0, end / 1024], [s["gib_at_zero"], s["gib_at_zero"] + s["kib_per_token"] * end / 2**20], "--",
                    color=dots.get_color(), linewidth=1)
    total = next((r["total_gib"] for r in results if r.get("total_gib")), None)
    if total:
        ax.axhline(total - args.margin_gib, color="grey", linewidth=1)
        ax.text(0, total - args.margin_gib, f" device memory less {args.margin_gib:g} GiB", va="bottom", fontsize=8)
    ax.set_xlim(0, top / 1024 if top else None)
    ax.set_xlabel("tokens in the row (k)")
    ax.set_ylabel("peak GiB (dots measured, dashes fitted)")
    ax.set_title(f"{args.model}, LoRA r=16{' over ' + args.quant.upper() if args.quant else ' (bf16 base)'}, batch 1")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quant", choices=["nf4", "fp4", "int8"], help="QLoRA (default: a bf16 base)")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--step", type=int, default=16384)
    parser.add_argument("--max", type=int, default=1 << 20)
    parser.add_argument("--lengths", type=int, nargs="+", metavar="SEQ",
                        help="after --start, only these lengths (a confirmation: one step at a predicted longest length)")
    parser.add_argument("--budget", type=float, default=120, help="seconds of ladder steps a setting (0: no limit)")
    parser.add_argument("--margin-gib", type=float, default=2.0, help="memory a prediction leaves free")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a setting's process may take")
    parser.add_argument("--out", help="append one JSON line a setting here")
    parser.add_argument("--plot", help="write a PNG of peak memory against length here (needs matplotlib)")
    args = parser.parse_args(argv)
    results = []
    for setting in args.settings:
        result = run_setting(setting, args)
        result["summary"] = summarise(result, args)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    print(table(results))
    if args.plot:
        plot(results, args, args.plot)


def table(results: list[dict]) -> str:
    lines = [f"{'setting':19} {'longest':>9}  {'how':40} {'KiB/token':>9}  tokens/s at each measured length"]
    for r in results:
        s = r["summary"]
        speeds = ", ".join(f"{p['seq']:,}: {p['tokens_per_s']:,}" for p in r["points"] if p["status"] == "ok")
        lines.append(f"{r['setting']:19} {s['longest']:9,d}  {s['how']:40} {s.get('kib_per_token', '-'):>9}  {speeds or r.get('error', '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
