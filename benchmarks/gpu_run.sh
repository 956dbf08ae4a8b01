#!/usr/bin/env bash
# One call on the GPU machine (the device tool): the benchmark stages named on the command line,
# in order, each under its own time limit; logs, JSON lines and profiles land in $OUT.
#   bash benchmarks/gpu_run.sh train-fast train-compile convergence
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tf-out}; mkdir -p "$OUT/prof"
if ls .whl/*.whl >/dev/null 2>&1; then  # packages for comparisons (liger-kernel; Unsloth: benchmarks/unsloth_wheels.md)
  rm -rf /tmp/site  # a warm machine keeps the last call's: pip --target left TRL 1.15 there under a 1.16 wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site || echo "gpu_run.sh: installing .whl failed: the peers' variants will be skipped"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
ts=benchmarks/train_step.py fc=benchmarks/fsdp_check.py
tr2="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
for stage in "$@"; do
  echo "=== $stage"
  case $stage in
    train-fast) timeout 240 python3 $ts --models llama1b qwen05b --variants eager torchfuser liger --profile-dir "$OUT/prof" --out "$OUT/train-step.jsonl" ;;
    train-compile-llama) timeout 450 python3 $ts --models llama1b --variants compile torchfuser+compile torchfuser+compile-ew --out "$OUT/train-step.jsonl" ;;
    train-compile-qwen) timeout 450 python3 $ts --models qwen05b --variants compile torchfuser+compile torchfuser+compile-ew --out "$OUT/train-step.jsonl" ;;
    compile-tests) timeout 240 python3 -m pytest -p no:cacheprovider tests/test_causal_mask.py tests/test_grouped_kv.py tests/backends/test_triton_compile.py tests/backends/test_triton_policy.py ;;
    residual-tests) timeout 330 python3 -m pytest -p no:cacheprovider tests/test_residual_norm.py tests/test_residual_forms_cuda.py tests/backends/test_residual_norm_kernels.py \
              tests/test_projections.py tests/test_cuda_graphs.py tests/test_architectures.py -k "not test_architectures or triton_backend" ;;
    postnorm-tests) timeout 300 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_post_block_cuda.py \
              tests/test_residual_post_block.py tests/backends/test_rms_norm_add_kernels.py tests/test_norm_dtypes.py tests/test_rope_unused_output.py ;;
    postnorm-probe) timeout 200 python3 benchmarks/probes/rms_norm_add_probe.py --out "$OUT/rms-norm-add-probe.jsonl" ;;
    graphs-tests) timeout 200 python3 -m pytest -p no:cacheprovider tests/test_cuda_graphs.py ;;
    train-bf16) timeout 400 python3 $ts --models qwen05b llama1b --variants eager torchfuser torchfuser-graphs --precision bf16 --profile-dir "$OUT/prof" --out "$OUT/train-step-bf16.jsonl" ;;
    train-cudagraphs) TORCH_LOGS=perf_hints timeout 580 python3 $ts --models ${MODELS:-qwen05b} --variants ${VARIANTS:-eager compile torchfuser-graphs torchfuser+compile torchfuser+compile-cudagraphs compile-cudagraphs} ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/train-step.jsonl" ;;
    train-fused) timeout 300 python3 $ts --models qwen05b llama1b --variants eager torchfuser torchfuser-graphs --out "$OUT/train-step.jsonl" ;;
    train-graphs) timeout 480 python3 $ts --models qwen05b llama1b --variants eager compile torchfuser torchfuser-graphs --profile-dir "$OUT/prof" --out "$OUT/train-step.jsonl" ;;
    ddp-graphs) timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/ddp_graphs_check.py --out "$OUT/ddp-graphs.json" ;;
    fsdp) for run in llama1b:mp-bf16 llama1b:autocast qwen05b:mp-bf16; do
            timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/fsdp_check.py \
              --recipe ${run%%:*} --precision ${run##*:} --out "$OUT/fsdp-${run%%:*}-${run##*:}.json"; done ;;
    fsdp1-profile) timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/fsdp_check.py \
              --wrap fsdp1 --recipe qwen05b --profile-dir "$OUT/prof" --out "$OUT/fsdp1-qwen05b-profiled.json" ;;
    fsdp1) for recipe in llama1b qwen05b; do
            timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/fsdp_check.py \
              --wrap fsdp1 --recipe $recipe --out "$OUT/fsdp1-$recipe-mp-bf16.json"; done ;;
    # Vision-language steps (issue 40): Qwen2.5-VL-7B LoRA vs eager and Liger; Gemma-3-4B full FT vs eager and compile.
    vlm) timeout 280 python3 benchmarks/vlm_step.py --shape qwen25vl7b --variants eager torchfuser liger --out "$OUT/vlm-step.jsonl"
         timeout 300 python3 benchmarks/vlm_step.py --shape gemma3-4b --variants eager torchfuser compile --out "$OUT/vlm-step.jsonl" ;;
    vlm-qwen) timeout 280 python3 benchmarks/vlm_step.py --shape qwen25vl7b --variants eager torchfuser liger ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/vlm-step.jsonl" ;;
    vlm-gemma) timeout 320 python3 benchmarks/vlm_step.py --shape gemma3-4b --variants eager torchfuser compile ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/vlm-step.jsonl" ;;
    # Gemma-3-4B with half its language model (17 of 34 layers), the full model's fp32 training state does not fit 80 GB
    vlm-gemma-half) timeout 300 python3 benchmarks/vlm_step.py --shape gemma3-4b --text-layers 17 --variants eager torchfuser compile ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/vlm-step.jsonl" ;;
    demo) timeout 150 python3 -m torchfuser.cli demo ;;
    convergence) timeout 120 python3 benchmarks/convergence.py --steps 50 --tolerance 0.01 --out "$OUT/convergence.json" ;;
    check) timeout 200 python3 benchmarks/gpu_check_triton.py --skip timings --out "$OUT/gpu-check.jsonl" ;;
    lce) timeout 120 python3 benchmarks/ops.py --device cuda --ops linear_cross_entropy --out "$OUT/ops-lce.jsonl" ;;
    lce-ab) timeout 300 python3 benchmarks/ops.py --device cuda --ops linear_cross_entropy --interleave 12 --profile-dir "$OUT/prof" --out "$OUT/ops-lce-interleaved.jsonl" ;;
    lce-probe) timeout 240 python3 benchmarks/probes/lce_probe.py ${LCE_PROBE_ARGS:-} --out "$OUT/lce-probe.jsonl" ;;
    families3-tests) timeout ${TESTS_S:-240} python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short tests/test_plain_mlp_acts.py \
              tests/test_post_norm_layers.py tests/test_alibi_attention.py tests/backends/test_triton_ops.py -k "cuda or activation or alibi" ;;
    families3-ops) timeout 120 python3 benchmarks/ops.py --device cuda --ops activation,gelu --out "$OUT/ops-activation.jsonl" ;;
    ops-small) timeout 200 python3 benchmarks/ops.py --device cuda --ops rms_norm,layer_norm,swiglu,geglu,gelu,rope --out "$OUT/ops.jsonl" ;;
    gated-probe) timeout 150 python3 benchmarks/probes/gated_probe.py --out "$OUT/gated-probe.jsonl" ;;
    host-profile) timeout 200 python3 benchmarks/probes/host_profile.py --model qwen05b --variants eager torchfuser --out "$OUT/host-profile.txt" ;;
    host-probe) timeout 90 python3 benchmarks/probes/host_path_probe.py --profile layer_norm --out "$OUT/host-path.jsonl" ;;
    ops) timeout 200 python3 benchmarks/ops.py --device cuda --out "$OUT/ops.jsonl" ;;
    arch-tests) timeout 200 python3 -m pytest -p no:cacheprovider tests/test_architectures.py -k triton_backend ;;
    proj-tests) timeout 120 python3 -m pytest -p no:cacheprovider tests/test_projections.py ;;
    sdpa-probe) timeout 120 python3 benchmarks/probes/sdpa_probe.py --out "$OUT/sdpa-probe.jsonl" ;;
    proj-probe) timeout 120 python3 benchmarks/probes/projection_probe.py --out "$OUT/projection-probe.jsonl" ;;
    triton-tests) timeout 200 python3 -m pytest -p no:cacheprovider tests/backends/test_triton_ops.py tests/backends/test_triton_compile.py ;;
    # The whole suite as the README runs it, one line per test as it ends (-v, addopts' -q dropped), so a
    # run cut by its time limit still says which tests failed; SUITE_ARGS picks a part (two halves fit a call).
    suite) timeout ${SUITE_S:-540} python3 -m pytest -p no:cacheprovider -n ${SUITE_N:-12} -o addopts="" -v -rfE ${SUITE_ARGS:-} ;;
    lce-label-ab) cp .ab/lce_before.py torchfuser/backends/triton/_lce_before.py \
            && timeout 150 python3 benchmarks/probes/lce_label_check_ab.py --rounds 12 | tee "$OUT/lce-label-ab.jsonl"
          rm -f torchfuser/backends/triton/_lce_before.py ;;
    bench) timeout ${BENCH_S:-300} python3 -m torchfuser.cli bench ${BENCH_MODEL:-llama} --device cuda --steps ${BENCH_STEPS:-12} \
            --variants ${BENCH_VARIANTS:-eager,torchfuser,torchfuser-autotune,torchfuser+graphs,compile} ${BENCH_ARGS:-} \
            --json "$OUT/bench.jsonl" --plot "$OUT/bench.png" ;;
    norm-wide) timeout 150 python3 benchmarks/probes/norm_bwd_wide_probe.py ${NORM_SHAPES:+--shapes $NORM_SHAPES} --out "$OUT/norm-bwd-wide.jsonl" ;;
    ft-fp8) timeout ${FT_S:-400} python3 $ts --models ${MODELS:-llama1b} --variants ${VARIANTS:-compile torchfuser torchfuser-fp8 torchfuser+compile torchfuser-fp8+compile} \
              ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/train-step-fp8.jsonl" ;;
    lora-probe) timeout 150 python3 benchmarks/probes/lora_kernels_probe.py --out "$OUT/lora-kernels-probe.jsonl" ;;
    vlm-heads-tests) timeout 240 python3 -m pytest -p no:cacheprovider tests/test_lm_head_vlm_forms.py tests/test_mlp_wrapped_projections.py -k cuda -rs ;;
    vlm-attn-tests) timeout 200 python3 -m pytest -p no:cacheprovider tests/test_rel_pos_attention.py tests/test_attention_norm_after_rope.py tests/test_vision_rotary_complex.py -k cuda -rs ;;
    varlen-probe) timeout 120 python3 benchmarks/probes/varlen_probe.py --out "$OUT/varlen-probe.jsonl" ;;
    ft-tests) timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="-rfE" -n 4 ${FT_TESTS:-tests/backends/test_residual_norm_kernels.py} \
              tests/test_workloads.py tests/test_packed_attention.py tests/backends/test_direct_launch_cuda.py tests/test_bench.py ;;
    # Fine-tuning workloads (issue 21): varying lengths, packed rows and the same samples padded, LoRA on llama8b.
    ft-varying) for m in ${MODELS:-qwen05b llama1b}; do timeout 200 python3 $ts --models $m --workload varying \
              --variants ${VARIANTS:-eager torchfuser torchfuser-graphs} --out "$OUT/train-step-varying.jsonl"; done ;;
    ft-packed) for w in packed padded-samples; do timeout 150 python3 $ts --models ${MODELS:-qwen05b} --workload $w --batch 2 \
              --variants ${VARIANTS:-eager torchfuser} --out "$OUT/train-step-packed.jsonl"; done ;;
    ft-lora) timeout 300 python3 $ts --models llama8b --precision bf16 --lora 16 --batch 2 --seq 2048 --steps 8 \
              --variants ${VARIANTS:-eager torchfuser} ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/train-step-lora.jsonl" ;;
    ft-lora-long) timeout 300 python3 $ts --models llama8b --precision bf16 --lora 16 --batch 1 --seq 16384 --steps 4 --warmup 2 \
              --grad-checkpointing --variants ${VARIANTS:-eager torchfuser} --out "$OUT/train-step-lora-16k.jsonl" ;;
    # Issue 36's target tables (LoRA r=16 on all seven projections, bf16 weights; same run as Unsloth): 8B at 2 × 2048;
    # 8B at 1 × 16384 without checkpointing, then with offloaded checkpointing (ours and Unsloth's) and HF's;
    # Qwen2.5-7B and Mistral-7B shapes; qwen05b full fine-tuning, the default against CUDA graphs.
    issue36-2k) timeout ${I36_S:-560} python3 $ts --models llama8b --precision bf16 --lora 16 --batch 2 --seq 2048 --warmup 12 --steps 8 \
              --variants ${VARIANTS:-torchfuser torchfuser-graphs torchfuser-offload unsloth unsloth-offload} --out "$OUT/issue36-llama8b-2x2048.jsonl" ;;
    issue36-16k) timeout ${I36_S:-560} python3 $ts --models llama8b --precision bf16 --lora 16 --batch 1 --seq 16384 --steps 4 --warmup 2 \
              --variants ${VARIANTS:-torchfuser torchfuser-offload unsloth unsloth-offload} --out "$OUT/issue36-llama8b-1x16384.jsonl" ;;
    issue36-16k-hf) timeout ${I36_S:-300} python3 $ts --models llama8b --precision bf16 --lora 16 --batch 1 --seq 16384 --steps 4 --warmup 2 \
              --grad-checkpointing --variants torchfuser --out "$OUT/issue36-llama8b-1x16384-hf-checkpointing.jsonl" ;;
    issue36-7b) timeout ${I36_S:-560} python3 $ts --models ${MODELS:-qwen7b mistral7b} --precision bf16 --lora 16 --batch 2 --seq 2048 --warmup 12 --steps 6 \
              --variants ${VARIANTS:-torchfuser torchfuser-graphs unsloth} --out "$OUT/issue36-7b-2x2048.jsonl" ;;
    # Host cost (branch host): the hi/lo split kernel compiled and checked bit for bit, the LoRA step with it
    host-tests) timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short \
              tests/backends/test_hilo_split.py tests/backends/test_hilo_split_ptx.py tests/test_lora_hilo_cuda.py tests/test_call_signatures.py ;;
    issue36-qwen05b) timeout ${I36_S:-300} python3 $ts --models qwen05b --variants torchfuser torchfuser-graphs \
              --out "$OUT/issue36-qwen05b.jsonl" ;;
    # cuda_graphs="auto" (optimize's default; "torchfuser-auto" names it explicitly) decides per stack after ~8 steps, hence
    # the warm-up; the notes in the JSON say what it chose and its timings. auto-tests: the GPU tests of auto and of optimize (graphs-tests: the explicit graphs).
    issue36-auto) timeout ${I36_S:-560} python3 $ts --models ${MODELS:-qwen05b} --warmup 12 --steps 8 --variants torchfuser torchfuser-auto torchfuser-graphs \
              --out "$OUT/issue36-auto-qwen05b.jsonl" ;;
    issue36-auto-2k) timeout ${I36_S:-560} python3 $ts --models llama8b --precision bf16 --lora 16 --batch 2 --seq 2048 --warmup 12 --steps 6 \
              --variants torchfuser torchfuser-auto torchfuser-graphs --out "$OUT/issue36-auto-llama8b-2x2048.jsonl" ;;
    auto-tests) timeout 300 python3 -m pytest -p no:cacheprovider -q -rfE tests/test_auto_graphs.py tests/test_optimize.py tests/test_optimize_again.py ;;
    # Issue 35's GPU checks: the tests fixed after the H200's run 1 and the FP8 weight-write tests.
    trust-tests) timeout ${TESTS_S:-240} python3 -m pytest -p no:cacheprovider -v -o addopts="" -rfE --tb=short -n 14 \
              tests/backends/test_dequant_4bit.py tests/backends/test_dequant_matmul_4bit.py tests/test_offload_checkpointing.py \
              tests/test_fp8_weight_writes.py ;;
    # Every GPU test written since the last device run (2026-12-05): CUDA cases of the CPU sessions' work, one call.
    pending-tests) timeout ${TESTS_S:-480} python3 -m pytest -p no:cacheprovider -v -o addopts="" -rfE --tb=short -n 14 \
              tests/backends/test_lce_frozen_head.py tests/test_recompute.py tests/test_lora_hilo_cuda.py \
              tests/test_plain_mlp_acts.py tests/test_post_norm_layers.py tests/test_alibi_attention.py \
              tests/test_rel_pos_attention.py tests/test_attention_norm_after_rope.py tests/test_vision_rotary_complex.py \
              tests/test_attention_v_norm.py tests/test_attention_blip.py tests/test_varlen_rotary_pairs.py \
              tests/test_residual_passed_layers.py tests/test_residual_dropout.py tests/test_mlp_inner_dropout.py \
              tests/test_decode_host_calls.py tests/test_generate_rl.py tests/test_auto_graphs.py \
              tests/test_residual_forms_cuda.py tests/test_attention_gemma4_vision.py tests/test_lm_head_scaled_softcap.py \
              tests/test_qlora_graphs.py tests/backends/test_dequant_4bit.py ;;
    offload-tests) timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short \
              tests/test_offload_checkpointing.py tests/test_checkpointing.py tests/test_bench.py ;;
    # Unsloth as a peer (issue 36; carry .whl from benchmarks/fetch_unsloth_wheels.sh): the smoke run fails fast
    # on the tiny Llama (import, load, both variants' steps, the first-step loss against PEFT's), then llama8b LoRA.
    unsloth-smoke) timeout ${SMOKE_S:-150} python3 $ts --models tiny --precision bf16 --lora 16 --batch 2 --seq 128 --warmup 1 --steps 2 \
              --variants ${SMOKE_VARIANTS:-unsloth unsloth-offload} --out "$OUT/train-step-unsloth-smoke.jsonl" ;;
    unsloth) timeout ${UNSLOTH_S:-420} python3 $ts --models ${MODELS:-llama8b} --precision bf16 --lora 16 --batch 2 --seq 2048 --steps 8 \
              --variants ${VARIANTS:-eager torchfuser torchfuser-graphs unsloth} --out "$OUT/train-step-lora-unsloth.jsonl" ;;
    # Issue 39, TRL's post-training trainers (docs/performance/NOTES-trl.md): carry .whl from benchmarks/fetch_trl_wheels.sh
    # (trl 1.16, liger-kernel). trl-head: TRL's chunked log-prob head against TorchFuser's linear+CE (the head decision);
    # trl-dpo / trl-grpo / trl-distill: whole steps, TRL alone, TRL + Liger, TRL + TorchFuserCallback (one call each).
    trl-head) timeout ${HEAD_S:-480} python3 benchmarks/lm_head_trl.py --device cuda ${HEAD_ARGS:-} --out "$OUT/lm-head-trl.jsonl" ;;
    trl-tests) timeout ${TESTS_S:-300} python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short \
              tests/test_trl_trainers.py tests/test_generate_rl.py tests/test_trl.py tests/test_trl_report.py tests/test_decode_host_calls.py \
              tests/test_decode_dispatch.py ;;
    trl-dpo) timeout ${TRL_S:-540} python3 benchmarks/trl_trainers.py --workload dpo ${TRL_ARGS:-} --out "$OUT/trl-dpo.jsonl" ;;
    trl-grpo) timeout ${TRL_S:-540} python3 benchmarks/trl_trainers.py --workload grpo ${TRL_ARGS:-} --out "$OUT/trl-grpo.jsonl" ;;
    trl-distill) timeout ${TRL_S:-540} python3 benchmarks/trl_trainers.py --workload distill ${TRL_ARGS:-} --out "$OUT/trl-distill.jsonl" ;;
    trl-rollouts) timeout 420 python3 benchmarks/probes/generate_rollouts.py --config qwen15b --device cuda --dtype bfloat16 \
              --batch 16 --prompt 128 --new ${NEW_TOKENS:-128} --backends auto reference --rounds 5 --report-mismatch \
              --out "$OUT/trl-rollouts.jsonl" ;;
    # QLoRA (issue 37): NF4 llama8b, PEFT vs TorchFuser vs Unsloth at 2 × 2048; then the longest context (batch 1, steps of
    # 16384 tokens until OOM) with QLoRA and with a bf16 base (CTX_S: seconds; each length is a process of its own).
    qlora) timeout ${QLORA_S:-480} python3 $ts --models ${MODELS:-llama8b} --precision bf16 --lora 16 --quant ${QUANT:-nf4} --batch 2 --seq 2048 \
              --steps 8 --variants ${VARIANTS:-eager torchfuser unsloth} --out "$OUT/train-step-qlora.jsonl" ;;
    qlora-tests) timeout 240 python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short tests/test_qlora_fused.py tests/test_qlora_torchao.py tests/test_qlora_graphs.py \
              tests/backends/test_dequant_4bit.py tests/backends/test_dequant_matmul_4bit.py ;;
    qlora-convergence) timeout 300 python3 benchmarks/qlora_convergence.py --device cuda --config ${MODELS:-llama1b} --steps 200 \
              --out "$OUT/qlora-convergence-${MODELS:-llama1b}" ;;
    qlora-probe) timeout 150 python3 benchmarks/probes/dequant_probe.py --out "$OUT/dequant-probe.jsonl" ;;
    qlora-gemm-probe) timeout 200 python3 benchmarks/probes/dequant_gemm_probe.py --out "$OUT/dequant-gemm-probe.jsonl" ;;
    # Three settings a call, each one process: build, 16k, then longer until OOM or ${CTX_BUDGET} s of steps (then a fit).
    context-qlora) timeout ${CTX_S:-580} python3 benchmarks/context_length.py --quant nf4 --budget ${CTX_BUDGET:-90} --timeout 240 \
                     ${CTX_ARGS:-} --out "$OUT/context-length-qlora.jsonl" --plot "$OUT/context-length-qlora.png" ;;
    # One step at a given length after a 16k warm-up (CTX_SETTING, CTX_LEN: a predicted longest length, confirmed).
    context-confirm) timeout ${CTX_S:-580} python3 benchmarks/context_length.py ${CTX_QUANT:+--quant $CTX_QUANT} --budget 0 \
                       --settings ${CTX_SETTING:-torchfuser-offload} --lengths ${CTX_LEN:-278528} --timeout 570 \
                       --out "$OUT/context-length-confirm.jsonl" ;;
    context-lora) timeout ${CTX_S:-580} python3 benchmarks/context_length.py --budget ${CTX_BUDGET:-90} --timeout 240 \
                    ${CTX_ARGS:-} --out "$OUT/context-length-lora.jsonl" --plot "$OUT/context-length-lora.png" ;;
    moe-path) timeout 120 python3 benchmarks/probes/moe_expert_path_probe.py --out "$OUT/moe-expert-path.jsonl" ;;
    moe-capture) timeout 120 python3 benchmarks/probes/moe_block_capture_probe.py ;;
    moe-train) timeout ${MOE_S:-500} python3 $ts --models ${MODELS:-qwen3moe olmoe} --variants ${VARIANTS:-torchfuser torchfuser-graphs} ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/train-step-moe.jsonl" ;;
    fp8-convergence) timeout ${CONV_S:-420} python3 benchmarks/fp8_convergence.py ${CONV_ARGS:-} --out "$OUT/fp8-convergence.json" ;;
    # The FP8 and MoE tests on the GPU, every failure's reason kept (-rfE --tb=short) in the stage's log.
    fp8-moe-tests) timeout ${TESTS_S:-240} python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short -n 8 \
              tests/backends/test_fp8_quant.py tests/test_fp8.py tests/backends/test_triton_moe.py tests/test_moe.py \
              tests/test_cuda_graphs.py tests/test_benchmark_tools.py ;;
    # Issue 23's GPU checks of what changed after run 125 (NOTES-fp8.md, "Left for issue 23"): the FP8 tests,
    # then the recipes and options side by side in one run.
    fp8-verify) timeout ${TESTS_S:-200} python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short -n 8 \
              tests/backends/test_fp8_quant.py tests/backends/test_fp8_blocks.py tests/test_fp8.py tests/test_fp8_per_step.py \
              tests/test_fp8_lm_head.py tests/test_fp8_blockwise.py tests/test_fp8_selfcheck.py tests/test_fp8_producers.py \
              tests/test_fp8_norm_producers.py ;;
    fp8-recipes) timeout ${FT_S:-500} python3 $ts --models llama1b --variants ${VARIANTS:-torchfuser-graphs torchfuser-fp8 \
              torchfuser-fp8-graphs torchfuser-fp8-pair torchfuser-fp8-pair-graphs torchfuser-fp8-tensorwise torchfuser-fp8-tensorwise-graphs \
              torchfuser-fp8-head torchfuser-fp8-head-graphs torchfuser-fp8-blockwise torchfuser-fp8-blockwise-graphs} ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/train-step-fp8-recipes.jsonl" ;;
    # The quantisation fused into the producers, whole steps with and without (noprod), eager and graphed.
    fp8-producers) timeout ${FT_S:-400} python3 $ts --models ${MODELS:-llama1b} --variants ${VARIANTS:-torchfuser-graphs torchfuser-fp8 \
              torchfuser-fp8-noprod torchfuser-fp8-graphs torchfuser-fp8-noprod-graphs} ${PROFILE:+--profile-dir "$OUT/prof"} \
              --out "$OUT/train-step-fp8-producers.jsonl" ;;
    fp8-sweep) timeout 330 python3 benchmarks/probes/fp8_both_ways_sweep_probe.py --out "$OUT/fp8-both-ways-sweep.jsonl" ;;
    fp8-norm-probe) timeout 200 python3 benchmarks/probes/fp8_norm_producer_probe.py --out "$OUT/fp8-norm-producer-probe.jsonl" ;;
    fp8-producer-bound) timeout 200 python3 benchmarks/probes/fp8_producer_bound_probe.py --out "$OUT/fp8-producer-bound.jsonl" ;;
    fp8-probe) timeout 120 python3 benchmarks/ops.py --device cuda --ops fp8 --out "$OUT/fp8-probe.jsonl" ;;
    fsdp-mesh) timeout 60 python3 benchmarks/probes/fsdp_default_mesh.py ;;
    # Issue 25 (2 × H200, nvidia-h200-x2): benchmarks/README.md's "Issue 25 runbook" says which call runs which.
    x2-llama1b) timeout 500 $tr2 $fc --recipe llama1b --precision mp-bf16 --variants eager torchfuser torchfuser+compile compile \
              --profile-dir "$OUT/prof" --out "$OUT/x2-llama1b-fsdp2-mp-bf16.json" ;;
    x2-llama8b-full) timeout 560 $tr2 $fc --recipe llama8b --precision mp-bf16 --grad-checkpointing --batch 2 --warmup 2 --steps 4 \
              --variants eager torchfuser compile --out "$OUT/x2-llama8b-full-fsdp2-mp-bf16-gc.json" ;;
    # DDP's mixed precision is torch's private _MixedPrecision: if it fails, the same run under autocast.
    x2-llama8b-lora) timeout 240 $tr2 $fc --recipe llama8b --wrap fsdp2 --lora 16 --precision mp-bf16 --batch 2 --out "$OUT/x2-llama8b-lora-fsdp2.json"
              timeout 240 $tr2 $fc --recipe llama8b --wrap ddp --lora 16 --precision mp-bf16 --batch 2 --out "$OUT/x2-llama8b-lora-ddp.json" \
              || timeout 280 $tr2 $fc --recipe llama8b --wrap ddp --lora 16 --precision autocast --batch 2 --out "$OUT/x2-llama8b-lora-ddp-autocast.json" ;;
    x2-qwen3moe) timeout 280 $tr2 $fc --recipe qwen3moe --precision mp-bf16 --variants eager torchfuser \
              --profile-dir "$OUT/prof" --out "$OUT/x2-qwen3moe-fsdp2-mp-bf16.json" ;;
    x2-fp8) timeout 280 $tr2 $fc --recipe llama1b --fp8 rowwise --precision autocast --variants eager torchfuser \
              --profile-dir "$OUT/prof" --out "$OUT/x2-llama1b-fsdp2-fp8-rowwise.json" ;;
    x2-ddp-graphs) timeout 120 $tr2 benchmarks/ddp_graphs_check.py --out "$OUT/x2-ddp-graphs.json"
              timeout 240 $tr2 $fc --recipe qwen05b --wrap ddp --precision autocast --variants eager torchfuser torchfuser-graphs \
              --profile-dir "$OUT/prof" --out "$OUT/x2-qwen05b-ddp-graphs.json" ;;
    # The communication overlap: where a fused step waits on a collective (FSDP2 here; FSDP1 is fsdp1-profile).
    x2-overlap) timeout 220 $tr2 $fc --recipe qwen05b --wrap fsdp2 --precision mp-bf16 --profile-dir "$OUT/prof" \
              --out "$OUT/x2-qwen05b-fsdp2-profiled.json" ;;
    # issue 38's broadened set: every family recipe with eager, torch.compile, Liger (where it has a patch) and
    # TorchFuser in one run, one model a process; MODELS / VARIANTS narrow it (a 10-minute device call holds 2-3 models).
    families) for m in ${MODELS:-gpt2_medium pythia1b4 qwen3_1_7b gemma2b starcoder2_3b phi3mini}; do
              timeout ${FAM_S:-280} python3 $ts --models $m --variants ${VARIANTS:-eager compile torchfuser liger} \
                ${PROFILE:+--profile-dir "$OUT/prof"} ${HOST_PROFILE:+--host-profile} --out "$OUT/train-step-families.jsonl"; done ;;
    # "before" in a before/after table, on the same machine: the same steps from another revision of the code, made
    # here by `mkdir -p .rev && git archive REV | gzip > .rev/REV.tgz` and carried (run's carry: [".rev"]);
    # REV=<rev> names it; each line of the output file carries {"code": REV}.
    families-at) d=/tmp/rev-$REV; rm -rf $d && mkdir -p $d && tar -xzf .rev/$REV.tgz -C $d
              for m in ${MODELS:-gpt2_medium pythia1b4 qwen3_1_7b gemma2b starcoder2_3b phi3mini}; do
                (cd $d && PYTHONPATH=$d:${PYTHONPATH#$PWD} timeout ${FAM_S:-280} python3 $ts --models $m \
                  --variants ${VARIANTS:-torchfuser} --out "$OUT/train-step-families-$REV.jsonl"); done
              [ -f "$OUT/train-step-families-$REV.jsonl" ] && python3 -c "import json,sys; p=sys.argv[1]; rows=[json.loads(l) | {'code': sys.argv[2]} for l in open(p)]
open(p, 'w').writelines(json.dumps(r) + chr(10) for r in rows)" "$OUT/train-step-families-$REV.jsonl" $REV ;;
    families-compose) for m in ${MODELS:-gpt2_medium pythia1b4 qwen3_1_7b gemma2b starcoder2_3b phi3mini}; do
              timeout ${FAM_S:-280} python3 $ts --models $m --variants ${VARIANTS:-torchfuser+compile} \
                --out "$OUT/train-step-families.jsonl"; done ;;
    # issue 38, round 4: BLOOM/MPT layers, dropout in training (their CUDA tests), BLOOM- and MPT-shaped steps.
    families4-tests) timeout ${TESTS_S:-240} python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short \
              tests/test_residual_passed_layers.py tests/test_residual_dropout.py tests/test_mlp_inner_dropout.py -k cuda ;;
    families4-train) for m in ${MODELS:-bloom560m mpt1b}; do
              timeout ${FAM_S:-280} python3 $ts --models $m --variants ${VARIANTS:-eager compile torchfuser} \
                ${PROFILE:+--profile-dir "$OUT/prof"} --out "$OUT/train-step-families4.jsonl"; done ;;
    # issue 38, session 6: Pythia's fused loss drifted from eager's (0.048 at the end of the run, others ≤ 0.004):
    # per-step losses of eager, auto (the default), graphs off, and the reference backend; then the residual CUDA tests.
    pythia-check) timeout 300 python3 $ts --models pythia1b4 --variants eager torchfuser torchfuser-nographs \
                    --steps 12 --out "$OUT/train-step-pythia-check.jsonl"
                  timeout 150 python3 $ts --models pythia1b4 --variants torchfuser-nographs --backend reference --steps 12 \
                    --out "$OUT/train-step-pythia-check.jsonl"
                  timeout 200 python3 -m pytest -p no:cacheprovider -q -o addopts="" -rfE --tb=short \
                    tests/test_residual_forms6_cuda.py tests/test_residual_forms_cuda.py ;;
    *) echo "unknown stage $stage" ;;
  esac 2>&1 | tee -a "$OUT/log-$stage.txt" | grep -v "^ *File \|^    " | tail -40
done
tar -C "$OUT" -czf "$OUT/profiles.tgz" prof && rm -rf "$OUT/prof"
