"""Resource report of every TorchFuser Triton kernel, per GPU target, from cross-compiled artifacts.

No GPU needed: each kernel is compiled (Triton's own compiler, ``triton.compile(..., target=...)``)
with the launch choices its launchers make for representative shapes on that target
(torchfuser/backends/triton/_crosscompile.py), and the artifacts are read: registers (NVIDIA:
the cubin through the bundled cuobjdump; AMD: VGPRs/AGPRs/SGPRs from the AMDGCN metadata),
spills (ptxas -v; the AMDGCN spill counts), shared memory / LDS, and an occupancy estimate.

    python benchmarks/triton_resources.py [--targets sm_90,sm_80,gfx942,gfx90a] [--quick]

Writes benchmarks/results/latest/triton_resources.json (one row per compiled kernel variant)
and triton_resources.md (a summary per kernel and target, the spills listed).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from torchfuser.backends.triton import _crosscompile as cc, targets  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "latest")
DEFAULT_TARGETS = ("sm_90", "sm_80", "gfx942", "gfx90a")


def run(target_names, quick=False):
    rows, failures = [], []
    for name in target_names:
        target = targets.TARGETS[name]
        with targets.simulate(target):
            launches = (cc.record_launches(hiddens=(123, 4096, 32768), dtypes=(torch.bfloat16,)) if quick
                        else cc.record_launches())
        t0 = time.time()
        for launch in launches:
            d = launch.describe()
            dtype = next(a for a in d["args"] if isinstance(a, str) and a.startswith("*")).lstrip("*")
            row = {"target": name, "gpu": target.gpu, "kernel": d["kernel"], "op": d["op"], "dtype": dtype,
                   "kwargs": d["kwargs"]}
            try:
                compiled = cc.compile_launch(launch, target.gpu_target())
                row.update(cc.resources(compiled, target))
            except Exception as e:  # a kernel that does not compile for a target is a finding, not a crash
                if "fp8e4nv not supported" in str(e):  # e4m3 writers where the target has no e4m3 cast:
                    row["refused"] = "no e4m3 on this target (FP8 is refused there: modules/fp8.check)"
                else:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    failures.append(row)
            rows.append(row)
        print(f"{name}: {len(launches)} kernel variants in {time.time() - t0:.0f} s", file=sys.stderr)
    return rows, failures


def summary(rows) -> list[str]:
    by = defaultdict(list)
    for r in rows:
        by[(r["kernel"], r["target"])].append(r)
    tnames = list(dict.fromkeys(r["target"] for r in rows))
    lines = ["| kernel | " + " | ".join(tnames) + " |", "|---" * (len(tnames) + 1) + "|"]
    for kernel in sorted({k for k, _ in by}):
        cells = []
        for t in tnames:
            rs = [r for r in by.get((kernel, t), []) if "error" not in r and "refused" not in r]
            if not rs:
                refused = any("refused" in r for r in by.get((kernel, t), []))
                cells.append("refused: no e4m3" if refused else "—")
                continue
            reg = "vgprs" if "vgprs" in rs[0] else "regs"
            regs = [r[reg] for r in rs]
            occ = [r["occupancy"] for r in rs if r.get("occupancy") is not None]
            spills = sum(1 for r in rs if r["spills"] or r.get("local") or r.get("scratch"))
            cells.append(f"{len(rs)} var.; {reg} {min(regs)}–{max(regs)}; shared ≤ {max(r['shared'] for r in rs)} B; "
                         f"occ. {min(occ):.2f}–{max(occ):.2f}" + (f"; **{spills} spill**" if spills else ""))
        lines.append(f"| {kernel} | " + " | ".join(cells) + " |")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default=",".join(DEFAULT_TARGETS))
    ap.add_argument("--quick", action="store_true", help="bf16 at hidden 123, 4096, 32768 only")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    names = args.targets.split(",")
    rows, failures = run(names, args.quick)
    refused = [r for r in rows if "refused" in r]
    spilling = [r for r in rows if "error" not in r and "refused" not in r and (r["spills"] or r.get("local") or r.get("stack") or r.get("scratch"))]
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "triton": triton.__version__, "torch": torch.__version__, "host": platform.machine(),
            "targets": {n: targets.TARGETS[n].gpu for n in names}, "quick": args.quick,
            "kernel_variants": len(rows), "refused": len(refused), "compile_failures": len(failures),
            "spilling": len(spilling)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "triton_resources.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, default=str)
        f.write("\n")
    md = [
        "# Triton kernels: resources per target (cross-compiled, no GPU)", "",
        f"{meta['date']}, Triton {meta['triton']}, torch {meta['torch']}; `python benchmarks/triton_resources.py`"
        + (" --quick" if args.quick else "") + ".",
        "Each kernel variant is compiled with the launch choices its launchers make for that target "
        "(hidden 64…32768, fp32/bf16/fp16, 8192 tokens; see torchfuser/backends/triton/_crosscompile.py). "
        "Registers: NVIDIA from the cubin (cuobjdump), AMD VGPRs from the AMDGCN metadata. Occupancy: "
        "resident warps / maximum (NVIDIA: from registers, shared memory and warps; AMD: LLVM's waves per SIMD / 8).",
        "", f"**{len(rows)} kernel variants, {len(failures)} compile failures, {len(spilling)} spilling**; "
        f"{len(refused)} refused as they must be: the FP8 kernels write e4m3, which the target has no cast for "
        "(sm_80; FP8 is refused there).", "",
        *summary(rows), "",
    ]
    if spilling:
        md += ["## Spills", "",
               "NVIDIA: bytes of spill stores + loads a thread (ptxas -v), and the stack frame they live in (cubin, STACK); AMD: VGPR + SGPR "
               "spill counts and scratch bytes. Which of these were timed on the H200 against the kernel's other "
               "forms (and are still the fastest), and which not: docs/hardware.md, \"Spills\".", "",
               "| target | kernel | op | dtype | constexprs | spills | stack / scratch B |", "|---|---|---|---|---|---|---|"]
        md += [f"| {r['target']} | {r['kernel']} | {r['op']} | {r['dtype']} | "
               + ", ".join(f"{k}={v}" for k, v in r["kwargs"].items())
               + f" | {r['spills']} | {r.get('stack', r.get('scratch'))} |" for r in spilling]
    if failures:
        md += ["", "## Compile failures", ""] + [f"- {r['target']} {r['kernel']} {r['kwargs']}: {r['error']}"
                                                  for r in failures]
    with open(os.path.join(args.out, "triton_resources.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
