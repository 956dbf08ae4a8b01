"""QLoRA convergence (issue 37): N steps of LoRA r=16 on an NF4 base (bitsandbytes, double quantisation),
PEFT's unfused model vs the same model fused, from the same weights, adapters and data (the demo's
learnable Zipf-like tokens); the loss curves must stay within a tolerance. JSON and a plot.

    python benchmarks/qlora_convergence.py --device cpu --steps 200 --out benchmarks/results/archive/qlora-convergence-cpu
    python benchmarks/qlora_convergence.py --device cuda --config llama1b --steps 200 --out ...   # compute dtype bf16
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torchfuser  # noqa: E402
from torchfuser import demo  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qlora_model(config: str, device, compute):
    import peft
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    fields = json.loads((ROOT / "recipes" / f"{config}.json").read_text())
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields, attn_implementation="sdpa")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=compute)
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, device_map={"": device},
                                                     dtype=torch.float32)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0))


def curve(model, size, steps, device, seed=0):
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    losses = []
    model.train()
    for ids in demo.batches(size, steps, device, seed):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="tiny_fp8", help="a recipes/*.json (every side a multiple of 64)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--out", help="write OUT.json and OUT.png")
    args = parser.parse_args()
    device = torch.device(args.device)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref = qlora_model(args.config, device, compute)
    fused = torchfuser.optimize(copy.deepcopy(ref))
    notes = [n for n in torchfuser.report(fused).notes if n.startswith(("adapters: ", "fallback: "))]
    vocab = ref.config.vocab_size
    size = replace(demo.SIZES["cpu"], vocab=vocab, batch=args.batch, seq=args.seq)
    curves = {"peft": curve(ref, size, args.steps, device), "torchfuser": curve(fused, size, args.steps, device)}
    diff = max(abs(a - b) for a, b in zip(*curves.values()))
    result = {"config": args.config, "device": str(device), "compute_dtype": str(compute), "steps": args.steps,
              "batch": args.batch, "seq": args.seq, "max_abs_loss_diff": diff, "tolerance": args.tolerance,
              "within": diff <= args.tolerance, "report_notes": notes, "losses": curves}
    print(json.dumps({k: v for k, v in result.items() if k != "losses"}))
    print(f"loss {curves['peft'][0]:.4f} → {curves['peft'][-1]:.4f} (PEFT), {curves['torchfuser'][-1]:.4f} (fused); "
          f"largest difference {diff:.2e}")
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result) + "\n")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, losses in curves.items():
            ax.plot(losses, label=name, linewidth=1.2, linestyle="--" if name == "torchfuser" else "-")
        ax.set(xlabel="step", ylabel="loss", title=f"QLoRA NF4 r=16, {args.config} on {device.type}: PEFT vs fused")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=110)
    sys.exit(0 if diff <= args.tolerance else 1)


if __name__ == "__main__":
    main()
