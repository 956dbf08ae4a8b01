#!/usr/bin/env bash
# The wheels benchmarks/trl_trainers.py and lm_head_trl.py need on the GPU machine (no network there), into .whl/
# (git-ignored; a device call carries it; gpu_run.sh installs every wheel in it). TRL 1.16 (the version the CPU
# tests use: its fused_lm_head and chunked kernels) and liger-kernel (the "trl+liger" peer, use_liger_kernel=True).
# datasets and its two pure-Python helpers as in fetch_unsloth_wheels.sh. Do not mix with that script's trl 1.15:
# an older trl wheel already in the folder is removed.
#   bash benchmarks/fetch_trl_wheels.sh            # into <repo>/.whl
set -euo pipefail
cd "$(dirname "$0")/.."
WHL=${WHL:-.whl}
PY=${PY:-python3}
mkdir -p "$WHL"
rm -f "$WHL"/trl-1.15*.whl
platform="--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: $platform -d "$WHL" \
  trl==1.16.0 liger-kernel==0.8.5 datasets==4.8.5 dill==0.4.1 multiprocess==0.70.19
du -sh "$WHL"; ls -l "$WHL"
