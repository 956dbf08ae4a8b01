"""Whole training steps of vision-language models: eager, torchfuser, Liger-Kernel, torch.compile.

    python benchmarks/vlm_step.py --shape qwen25vl7b --variants eager torchfuser liger --out vlm-step.jsonl
    python benchmarks/vlm_step.py --shape gemma3-4b --variants eager torchfuser compile --out vlm-step.jsonl
    python benchmarks/vlm_step.py --shape gemma3-4b --text-layers 17 ...   # half the language model: fits 80 GB
    python benchmarks/vlm_step.py --shape tiny-qwen25vl --device cpu --steps 2   # smoke run

Shapes (random weights, configs written here, nothing downloaded):
- ``qwen25vl7b``: Qwen2.5-VL-7B; LoRA r=16 on the language model's projections (frozen bf16 weights, as LoRA
  fine-tuning runs); the vision tower frozen too.
- ``gemma3-4b``: Gemma-3-4B, both towers trained (full fine-tuning: fp32 parameters, bf16 autocast, AdamW).
Batch: 2 rows, each one 1024 × 1024 image and 512 text tokens (Qwen2.5-VL: 74 × 74 patches of 14 px,
1369 image tokens a row after the 2 × 2 merge, as its processor resizes 1024 px to 1036; Gemma 3: its
processor's 896 px, 256 image tokens). Labels: the text tokens, image tokens -100. Each variant builds the
model afresh from one seed; one JSON line per variant (median ms/step of the timed steps, tokens/s counting
every token of the rows, peak memory, first/last loss), then a table against eager.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

QWEN_TEXT = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                   fullatt_block_indexes=[7, 15, 23, 31], window_size=112, hidden_act="silu")
GEMMA_TEXT = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=256, vocab_size=262208, sliding_window=1024,
                  query_pre_attn_scalar=256)
GEMMA_VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                    image_size=896, patch_size=14, vision_use_head=False)  # as the released config: no pooling head
SHAPES = {
    "qwen25vl7b": ("qwen2_5_vl", QWEN_TEXT, QWEN_VISION, dict(side=74, lora=16)),
    "gemma3-4b": ("gemma3", GEMMA_TEXT, GEMMA_VISION, dict(side=896, lora=0)),
    "tiny-qwen25vl": ("qwen2_5_vl", dict(QWEN_TEXT, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}),
                      dict(QWEN_VISION, depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                           fullatt_block_indexes=[1]), dict(side=8, lora=4)),
    "tiny-gemma3": ("gemma3", dict(GEMMA_TEXT, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, vocab_size=1024, query_pre_attn_scalar=32),
                    dict(GEMMA_VISION, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         image_size=112), dict(side=112, lora=0, mm_tokens_per_image=16)),
}
IMAGE_TOKEN = 5  # an id of the vocabulary's low range set aside as the image token (random weights: any id will do)


def build(shape: str, device, dtype, text_layers: int | None = None):
    import transformers

    kind, text, vision, extra = SHAPES[shape]
    if text_layers:
        text = dict(text, num_hidden_layers=text_layers)
    cfg_cls = transformers.AutoConfig.for_model(kind).__class__
    kw = {"mm_tokens_per_image": extra["mm_tokens_per_image"]} if "mm_tokens_per_image" in extra else {}
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, attn_implementation="sdpa", **kw)
    if kind == "gemma3":
        cfg.image_token_index = IMAGE_TOKEN
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForImageTextToText.from_config(cfg, dtype=dtype if extra["lora"] else torch.float32)
    if extra["lora"]:
        from peft import LoraConfig, get_peft_model

        model.requires_grad_(False)
        lora = LoraConfig(r=extra["lora"], lora_alpha=2 * extra["lora"], lora_dropout=0.0,
                          target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
        model = get_peft_model(model, lora)
    return model.train(), cfg


def batch(shape: str, cfg, device, rows: int = 2, text: int = 512):
    kind, _, vision, extra = SHAPES[shape]
    gen = torch.Generator().manual_seed(1)
    if kind == "qwen2_5_vl":
        side = extra["side"]
        patch = cfg.vision_config.patch_size
        pixels = torch.randn(rows * side * side, 3 * 2 * patch * patch, generator=gen)
        inputs = {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, side, side]] * rows)}
        n_image = side * side // 4
    else:
        pixels = torch.randn(rows, 3, extra["side"], extra["side"], generator=gen)
        inputs = {"pixel_values": pixels}
        n_image = cfg.mm_tokens_per_image
    ids = torch.randint(16, cfg.text_config.vocab_size, (rows, n_image + text), generator=gen)
    ids[:, 4:4 + n_image] = IMAGE_TOKEN
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    inputs.update(input_ids=ids, labels=labels, attention_mask=torch.ones_like(ids))
    if kind == "gemma3":
        inputs["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    else:
        inputs["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
    return {k: v.to(device) for k, v in inputs.items()}, ids.numel()


def prepare(model, variant: str, kind: str):
    if variant == "torchfuser":
        import torchfuser

        torchfuser.optimize(model)
        print(torchfuser.report(model).summary(), flush=True)
    elif variant == "liger":
        import liger_kernel.transformers as liger

        # its patch takes the transformers model, not PEFT's wrapper (the LoRA shapes wrap it); the wrapper's forward
        # then calls the patched one
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        getattr(liger, f"apply_liger_kernel_to_{kind}")(model=base)
    elif variant == "compile":
        model.compile()
    elif variant != "eager":
        raise SystemExit(f"unknown variant {variant!r}")
    return model


def run(shape: str, variant: str, args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, cfg = build(shape, device, dtype, args.text_layers)
    model = prepare(model, variant, SHAPES[shape][0])
    inputs, tokens = batch(shape, cfg, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    def one_step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(**inputs, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        loss = one_step()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t)
        losses.append(loss.item())
    ms = 1e3 * statistics.median(times)
    if args.profile_dir:  # two more steps under the profiler: the kernels by self time, and the GPU's idle gaps
        from pathlib import Path

        from profiling import copies_by_shape, gpu_idle, profiled, write_tables

        prof = profiled(one_step, device, 2, record_shapes=True)
        write_tables(prof, Path(args.profile_dir) / f"profile-{shape}-{variant}.txt",
                     ("self_cuda_time_total" if cuda else "self_cpu_time_total",), 90, 200,
                     (gpu_idle(prof) if cuda else "") + copies_by_shape(prof))
    return {"shape": shape, "variant": variant, "text_layers": cfg.text_config.num_hidden_layers, "ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "loss_first": losses[0], "loss_last": losses[-1], "steps": args.steps,
            "step_ms": [round(1e3 * t, 2) for t in times]}  # auto's deciding steps (CUDA graphs) show here


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen25vl7b", choices=sorted(SHAPES))
    p.add_argument("--variants", nargs="+", default=["eager", "torchfuser"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--text-layers", type=int, help="the language model's depth, if not the shape's (full fine-tuning "
                   "of gemma3-4b keeps ≈ 70 GB of fp32 weights, gradients and AdamW state: 17 of its 34 layers fit 80 GB)")
    p.add_argument("--out", help="append one JSON line per variant here")
    p.add_argument("--profile-dir", help="after the timed steps, two profiled ones: a table per variant here")
    args = p.parse_args()
    rows = []
    for variant in sorted(args.variants, key=lambda v: v == "liger"):  # Liger patches classes globally: last
        try:
            row = run(args.shape, variant, args)
        except Exception as err:  # a peer not installed, out of memory: say so, go on
            row = {"shape": args.shape, "variant": variant, "error": f"{type(err).__name__}: {err}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = next((r for r in rows if r["variant"] == "eager" and "error" not in r), None)
    print(f"\n{'variant':<12} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'vs eager':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} {r['error']}")
            continue
        ratio = f"{base['ms_per_step'] / r['ms_per_step']:.2f}x" if base else "-"  # no eager run: no ratio
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"{r['variant']:<12} {r['ms_per_step']:9.1f} {r['tokens_per_s']:10.0f} {peak:>9} {ratio:>9}")


if __name__ == "__main__":
    main()
