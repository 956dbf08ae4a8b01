"""What one decoder layer keeps for its backward, by tensor: PEFT unfused against fused, LoRA on a bf16 base.

Issue 36 measured ≈ 18.7 hidden-sized bf16 tensors a token a layer kept by the fused 8B LoRA step at 16384 tokens
against Unsloth's ≈ 15.0 (docs/performance/NOTES-lora.md). This counts, on the device the tensors live on, every
tensor saved for the backward during the forward of a llama8b-shaped model of two layers (a saved-tensor hook
marked ``recompute.COUNTING``, so h = act(gate)·up stays made again; storages counted once, parameters left out),
in units of one hidden-sized bf16 tensor a token a layer, with the largest saved tensors listed, and how many
tensors were packed as recipes (made again in the backward) rather than kept.

    python benchmarks/probes/saved_bytes_probe.py [--tokens 2048] [--out probe.jsonl]    # GPU, llama8b layers
    python benchmarks/probes/saved_bytes_probe.py --small                                # CPU, small sizes
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _emit import emitter  # noqa: E402

import torchfuser  # noqa: E402
from torchfuser.modules import recompute  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(small: bool, device, layers: int = 2):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = (dict(hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=1, vocab_size=256)
            if small else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                               vocab_size=128256))
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **dims)).to(torch.bfloat16)
    model.config.use_cache = False
    return peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))


def count(model, tokens: int, device):
    """(bytes saved by the forward, {(shape, dtype): bytes}, recipes packed) for one training forward and backward."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = (t.untyped_storage().nbytes(), tuple(t.shape), str(t.dtype).removeprefix("torch."))
        return t

    setattr(pack, recompute.COUNTING, True)
    before = recompute.RECIPES[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(v[0] for v in seen.values()), sorted(seen.values(), reverse=True), recompute.RECIPES[0] - before


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--small", action="store_true", help="small sizes on the CPU (a check that it runs)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    tokens = 64 if args.small else args.tokens
    emit = emitter(args.out, {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                              "torch": torch.__version__})
    for variant in ("peft", "fused"):
        saved = {}
        for layers in (1, 2):  # one layer more: what a decoder layer adds (embedding and LM head cancel)
            model = build(args.small, device, layers)
            if variant == "fused":
                torchfuser.optimize(model)
            saved[layers] = count(model, tokens, device)
            unit = tokens * model.config.hidden_size * 2
            del model
        (one, _, _), (two, largest, recipes) = saved[1], saved[2]
        emit(variant=variant, tokens=tokens, units_a_token_a_layer=round((two - one) / unit, 2),
             saved_mib_two_layers=round(two / 2**20, 1), recipes_two_layers=recipes,
             largest=[f"{s} {d} {b / 2**20:.1f} MiB" for b, s, d in largest[:16]])


if __name__ == "__main__":
    main()
