"""The longest context that trains on one GPU (issue 37): batch 1, LoRA r=16 on all seven projections of
llama8b's shape (bf16 base, or ``--quant nf4``: QLoRA), lengths going up in steps of 16384 tokens until
out of memory, tokens/s and peak memory at each, for each setting:

    peft-hf-ckpt      PEFT + HF gradient checkpointing (non-reentrant)         train_step eager --grad-checkpointing
    unsloth-offload   Unsloth with its offloaded gradient checkpointing       train_step unsloth-offload
    torchfuser        TorchFuser's default path (fused LM head + loss: the      train_step torchfuser --grad-checkpointing
                      logits never built) with HF checkpointing

Each (setting, length) is one ``train_step.py`` process (a fresh CUDA context: an OOM leaves nothing behind
for the next length); a setting stops at its first failing length. One JSON line per run, then a table.
TorchFuser's best settings grow as they land (offloaded checkpointing, chunked MLP): ``--torchfuser-args``
passes train_step flags to the torchfuser setting only.

    python benchmarks/context_length.py --quant nf4 --out benchmarks/results/archive/context-length-qlora.jsonl
    python benchmarks/context_length.py --model tiny --device cpu --start 64 --step 64 --max 128   # smoke run
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {
    "peft-hf-ckpt": ["--variants", "eager", "--grad-checkpointing"],
    "unsloth-offload": ["--variants", "unsloth-offload"],
    "torchfuser": ["--variants", "torchfuser", "--grad-checkpointing"],
}
_OOM = ("OutOfMemory", "out of memory", "CUDA error: out of memory")


def run_one(setting: str, seq: int, args) -> dict:
    extra = SETTINGS[setting] + (args.torchfuser_args.split() if setting == "torchfuser" and args.torchfuser_args else [])
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as out:
        cmd = [sys.executable, str(HERE / "train_step.py"), "--models", args.model, "--device", args.device,
               "--precision", "bf16", "--lora", "16", "--batch", "1", "--seq", str(seq), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--out", out.name, *(["--quant", args.quant] if args.quant else []), *extra]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            return {"setting": setting, "seq": seq, "status": "timeout", "timeout_s": args.timeout}
        rows = [json.loads(line) for line in Path(out.name).read_text().splitlines() if line.strip()]
    row = rows[-1] if rows else {"error": f"no result (exit {proc.returncode}): {tail[-400:]}"}
    text = json.dumps(row) + ("" if rows else tail)
    status = "ok" if "ms_per_step" in row else "oom" if any(s in text for s in _OOM) else \
        "skipped" if "skipped" in row else "error"
    return {"setting": setting, "seq": seq, "status": status, "quant": args.quant,
            **{k: row.get(k) for k in ("tokens_per_s", "ms_per_step", "peak_gib", "first_loss", "fused_blocks")},
            **({"why": (row.get("error") or row.get("skipped") or "")[:300]} if status != "ok" else {})}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quant", choices=["nf4", "fp4", "int8"], help="QLoRA (default: a bf16 base)")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--start", type=int, default=16384)
    parser.add_argument("--step", type=int, default=16384)
    parser.add_argument("--max", type=int, default=1 << 20)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run (then the setting stops)")
    parser.add_argument("--torchfuser-args", default="", help="more train_step flags for the torchfuser setting")
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args(argv)
    rows = []
    for setting in args.settings:
        for seq in range(args.start, args.max + 1, args.step):
            row = run_one(setting, seq, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if row["status"] != "ok":
                break
    print(f"{'setting':16} {'longest':>9} {'tok/s there':>12} {'peak GiB':>9}  stopped by")
    for setting in args.settings:
        ok = [r for r in rows if r["setting"] == setting and r["status"] == "ok"]
        last = [r for r in rows if r["setting"] == setting][-1:]
        best = ok[-1] if ok else {}
        print(f"{setting:16} {best.get('seq', 0):9,d} {best.get('tokens_per_s') or 0:12,d} {best.get('peak_gib') or '-':>9}  "
              f"{last[0]['status'] + ' at ' + format(last[0]['seq'], ',') if last and last[0]['status'] != 'ok' else 'the --max length'}")


if __name__ == "__main__":
    main()
