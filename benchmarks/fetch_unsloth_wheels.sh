#!/usr/bin/env bash
# The wheels train_step.py's unsloth variants need on the GPU machine (which has no network), into .whl/
# (git-ignored; a device call carries it). benchmarks/unsloth_wheels.md says why each is there and why
# the rest of Unsloth's requirements are left out. Run from anywhere; prints the folder's size.
#   bash benchmarks/fetch_unsloth_wheels.sh            # into <repo>/.whl
#   WHL=/tmp/w bash benchmarks/fetch_unsloth_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=${WHL:-.whl}
PY=${PY:-python3}
mkdir -p "$WHL"
# The GPU machine: CPython 3.12 on x86-64 Linux (pure-Python wheels are py3-none-any).
platform="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: $platform -d "$WHL" \
  unsloth==2026.10.9 unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 trl==1.15.0 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19

# Repack two wheels to fit the 64 MiB a device call carries: bitsandbytes keeps its Python code and only
# the CPU and CUDA 13.0 libraries (torch 2.11+cu130 loads libbitsandbytes_cuda130.so; 43 MB → ~3 MB),
# unsloth drops its Studio web app and CLI (studio/, unsloth_cli/: 28 MB → ~2 MB; `import unsloth` never
# reads them). RECORD is rewritten to list what is left.
$PY - "$WHL" <<'EOF'
import sys, zipfile
from pathlib import Path

def keep_bnb(name):
    lib = name.startswith("bitsandbytes/libbitsandbytes_")
    return not lib or name.endswith(("_cpu.so", "_cuda130.so"))

def keep_unsloth(name):
    return not name.startswith(("studio/", "unsloth_cli/"))

for pattern, keep in (("bitsandbytes-*.whl", keep_bnb), ("unsloth-2*.whl", keep_unsloth)):
    for wheel in Path(sys.argv[1]).glob(pattern):
        with zipfile.ZipFile(wheel) as src:
            names = src.namelist()
            if all(keep(n) for n in names):
                continue  # repacked already
            tmp = wheel.with_suffix(".tmp")
            with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in src.infolist():
                    if not keep(info.filename):
                        continue
                    data = src.read(info)
                    if info.filename.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines()
                        data = ("\n".join(l for l in lines if keep(l.split(",")[0])) + "\n").encode()
                    dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
        tmp.replace(wheel)
        print(f"repacked {wheel.name}: {len(names)} → {sum(keep(n) for n in names)} files")
EOF
du -sh "$WHL"; ls -l "$WHL"
