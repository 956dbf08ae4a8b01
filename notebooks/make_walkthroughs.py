"""Regenerates every notebook in this folder: the walkthroughs 03-07 from one template, then the outputs of all.

    python notebooks/make_walkthroughs.py            # every notebook: sources of 03-07, outputs of 01-08
    python notebooks/make_walkthroughs.py 02 07      # only these (a file name or its number)
    python notebooks/make_walkthroughs.py --sources-only   # 03-07 without outputs, nothing run

The walkthroughs 03-07 are written from the template below, so that they stay alike; 01, 02 and 08
are written by hand and keep their sources. Each notebook then runs in a fresh process, as in a new
Jupyter kernel (nbrun.py: no Jupyter needed), and is written back with its outputs, without this
machine's paths, host name or timestamps. Run it after a change that alters what a notebook prints:
tests/test_notebooks.py runs every notebook again and fails when its committed outputs differ from
the fresh run in anything but timings (nbrun.mask_timings says what counts as one).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nbrun  # noqa: E402

OUT = Path(__file__).resolve().parent
WALKTHROUGHS: dict[str, dict] = {}  # file name -> the notebook, without outputs

def md(text): return {"cell_type": "markdown", "metadata": {}, "source": text.strip("\n").splitlines(keepends=True)}
def code(text): return {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": text.strip("\n").splitlines(keepends=True)}

FUSE = '''
keys_before = list(model.state_dict())
params_before = [id(p) for p in model.parameters()]
torchfuser.optimize(model)  # backend "auto": mlir on a CPU (reference where torch-mlir is missing), triton on a GPU
assert list(model.state_dict()) == keys_before            # the same names...
assert [id(p) for p in model.parameters()] == params_before  # ...and the very same parameter objects
rep = torchfuser.report(model)
print(rep)
'''

CHECK = '''
gen = torch.Generator().manual_seed(1)
ids = torch.randint(3, cfg.vocab_size, (BATCH, SEQ), generator=gen)

def loss_and_grads(m):
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

loss, grads = loss_and_grads(model)
loss_ref, grads_ref = loss_and_grads(reference)
assert list(grads) == list(grads_ref)  # every parameter got a gradient in both, under the same name
# Each gradient's largest difference, relative to that gradient's largest entry.
rel = {n: ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in grads_ref.items()}
worst = max(rel, key=rel.get)
assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref) and rel[worst] < 1e-4, (loss, loss_ref, worst, rel[worst])
# Printed to the tolerance checked: the last bits of an fp32 sum differ from one CPU to another.
print(f"loss {loss:.4f} fused vs {loss_ref:.4f} original: the same within 1e-5 (relative)")
print(f"{len(rel)} gradients compared: each the same within 1e-4 of its largest entry")
'''

TIME = '''
import time

def train_step(m):
    m.zero_grad(set_to_none=True)
    m(input_ids=ids, labels=ids).loss.backward()

def step_ms(m):
    t = time.perf_counter()
    train_step(m)
    return 1e3 * (time.perf_counter() - t)

for m in (model, reference):  # warm-up: the first fused call compiles its kernels
    train_step(m)
times = {"eager": [], "torchfuser": []}
for _ in range(STEPS):  # interleaved, so that a busy machine slows both alike
    times["eager"].append(step_ms(reference))
    times["torchfuser"].append(step_ms(model))
# The fastest step of each: on a shared machine other work only ever adds time.
best = {k: min(v) for k, v in times.items()}
threads = torch.get_num_threads()
print(f"forward + backward, batch {BATCH} x {SEQ} tokens, fp32, {threads} CPU threads, fastest of {STEPS} steps "
      f"(slowest eager {max(times['eager']):.0f} ms, torchfuser {max(times['torchfuser']):.0f} ms):")
for k, v in best.items():
    print(f"  {k:>10}: {v:7.1f} ms  ({BATCH * SEQ / v * 1e3:,.0f} tokens/s)")
print(f"  speed-up: {best['eager'] / best['torchfuser']:.2f}x  (this run, this CPU)")
'''

PLOT = '''
try:
    import matplotlib
    import matplotlib.pyplot as plt
except ImportError:  # the numbers above say the same
    plt = None
if plt is not None:
    if "ipykernel" not in matplotlib.get_backend().lower() and "inline" not in matplotlib.get_backend().lower():
        matplotlib.use("Agg")  # run outside Jupyter (the tests): draw, show nothing
    fig, ax = plt.subplots(figsize=(5, 2.2))
    names = list(best)
    ax.barh(names, [best[n] for n in names], color=["#999999", "#d9622b"])
    for i, n in enumerate(names):
        ax.plot(times[n], [i] * len(times[n]), "k|", markersize=12)  # every measured step
    ax.set_xlabel(f"ms per training step (bar: fastest, ticks: every step; batch {BATCH} x {SEQ}, CPU, this run)", fontsize=8)
    ax.set_title(TITLE + ": eager vs torchfuser")
    fig.tight_layout()
    plt.show()
'''

RESTORE = '''
torchfuser.restore(model)
assert not any(isinstance(m, FusedModule) for m in model.modules())
assert list(model.state_dict()) == keys_before
loss_back, _ = loss_and_grads(model)
print(f"restored: {type(model).__name__} of plain transformers modules, loss {loss_back:.4f}")
assert abs(loss_back - loss_ref) <= 1e-5 * abs(loss_ref)
'''

IMPORTS = '''
import copy
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import torchfuser
from torchfuser.modules.base import FusedModule

torch.manual_seed(0)
'''

def notebook(name, title, intro, config, special_md, special_code, batch=4, seq=64, steps=8, extra_end=None):
    cells = [
        md(f"# {title} with TorchFuser\n\n{intro}\n\nEverything runs on the CPU in seconds, with random weights and no downloads. "
           "The timings below are what this run measured on the machine that executed the notebook (a small "
           "CPU, a tiny model): they show how to measure, not what a GPU gains. `benchmarks/train_step.py` measures real sizes."),
        code(IMPORTS + "\n" + config.strip() + f"\nBATCH, SEQ, STEPS, TITLE = {batch}, {seq}, {steps}, {title!r}\n"
             "model = AutoModelForCausalLM.from_config(cfg)\nreference = copy.deepcopy(model)  # the untouched original, for comparison\n"
             "print(f\"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters\")"),
        md("## Fuse\n\n`optimize` swaps blocks in place and returns the model. The report lists every candidate block: "
           "fused (with the backend) or skipped (with the reason)."),
        code(FUSE),
        md(special_md),
        code(special_code),
        md("## Same loss, every gradient the same\n\nOne training step of the fused model against the untouched copy, "
           "in fp32. Every parameter's gradient is compared, not just the loss."),
        code(CHECK),
        md("## Eager against fused\n\nA few forward + backward steps of each, after one warm-up step (the first fused "
           "call compiles its kernels). The fastest step of each is the figure: on a shared machine other work only adds time. "
           "On a tiny model on a CPU the fused kernels can lose to eager; that is a measurement, not a promise either way."),
        code(TIME),
        code(PLOT),
        md("## Undo\n\n`restore` puts the original modules back; the parameters never moved."),
        code(RESTORE),
    ]
    if extra_end:
        cells += extra_end
    nb = {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                                        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"{name[:2]}-{i:02d}"
    WALKTHROUGHS[name] = nb

TINY = '''hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1024, attn_implementation="sdpa"'''

notebook("03_llama.ipynb", "Llama",
    "Llama is the template most open models follow: RMSNorm, a SiLU gate/up/down MLP, rotary attention with "
    "grouped key/value heads, a tied or untied LM head. Mistral, Qwen2, Phi-3, SmolLM and many more are built the same way, "
    "and TorchFuser recognises them by structure, not by class name.",
    f'cfg = AutoConfig.for_model("llama", {TINY})',
    "## What was found\n\nThe report in numbers: every block kind of a Llama is fused. `lm_head_loss` computes "
    "the LM head and the cross-entropy together, without keeping the full logits for the backward.",
    '''
counts = rep.counts()
print(counts)
assert not rep.skipped
assert counts["attention"]["fused"] == cfg.num_hidden_layers and counts["gated_mlp"]["fused"] == cfg.num_hidden_layers
assert counts["rms_norm"]["fused"] == 2 * cfg.num_hidden_layers + 1 and counts["lm_head_loss"]["fused"] == 1
''')

notebook("04_qwen3.ipynb", "Qwen3",
    "Qwen3 is Llama-shaped with one addition: an RMSNorm on each head's queries and keys (`q_norm`, `k_norm`) "
    "before the rotary embedding. The fused attention applies those norms itself, so the whole attention block is fused.",
    f'cfg = AutoConfig.for_model("qwen3", {TINY}, head_dim=32)',
    "## The per-head query/key norms\n\nBesides the two norms per layer and the final one, each attention block "
    "holds a `q_norm` and a `k_norm` over the head dimension: the report shows them fused too.",
    '''
counts = rep.counts()
print(counts)
attn = model.model.layers[0].self_attn
print(type(attn).__name__, "holds", type(attn.q_norm).__name__, "and", type(attn.k_norm).__name__,
      f"over {attn.q_norm.weight.numel()} channels (the head dimension)")
assert not rep.skipped and counts["attention"]["fused"] == cfg.num_hidden_layers
assert counts["rms_norm"]["fused"] == 4 * cfg.num_hidden_layers + 1  # input, post-attention, q_norm, k_norm; final
''')

notebook("05_gemma.ipynb", "Gemma",
    "Gemma differs from Llama in small ways that matter to a kernel: its RMSNorm scales by `1 + w` (the weight "
    "is stored as an offset from one), the MLP uses tanh-approximated GELU, and the embeddings are multiplied by "
    "√hidden. TorchFuser reads those differences off the modules (a field of a spec, not a Gemma subclass).",
    f'cfg = AutoConfig.for_model("gemma", {TINY}, head_dim=32)',
    "## Gemma's norm\n\nThe fused norm carries the offset in its spec: `x · rsqrt(mean(x²) + eps) · (offset + w)`.",
    '''
norm = model.model.norm
print(type(norm).__name__, norm.spec)
mlp = model.model.layers[0].mlp
print(type(mlp).__name__, mlp.spec)
assert norm.spec.offset == 1.0
assert not rep.skipped
''')

notebook("06_gpt2.ipynb", "GPT-2",
    "GPT-2 is the older layout: LayerNorm with a bias, learned position embeddings instead of rotary, a "
    "GELU MLP without a gate, and `Conv1D` projections (a Linear with its weight transposed) with the "
    "query, key and value packed in one `c_attn`. Each of those is a spec field to TorchFuser.",
    '''cfg = AutoConfig.for_model("gpt2", n_embd=128, n_layer=2, n_head=4, vocab_size=1024, n_positions=256,
                         attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=1, eos_token_id=2)''',
    "## LayerNorm, Conv1D, packed QKV\n\nThe MLP is `c_fc → gelu → c_proj` (`mlp`, not `gated_mlp`); the attention "
    "splits the packed `c_attn` output; the norms are `layer_norm`, and each block's residual adds run inside "
    "them (`residual_norm`, the block's forward replaced on the instance).",
    '''
counts = rep.counts()
print(counts)
block = model.transformer.h[0]
print(type(block.attn).__name__, block.attn.spec.layout, "| c_attn is", type(block.attn.c_attn).__name__)
assert not rep.skipped
assert counts["layer_norm"]["fused"] == 2 * cfg.n_layer + 1 and counts["mlp"]["fused"] == cfg.n_layer
assert counts["residual_norm"]["fused"] == cfg.n_layer
''')

notebook("07_mixtral_moe.ipynb", "Mixtral (mixture of experts)",
    "Mixtral replaces each layer's MLP with a sparse mixture-of-experts block: a router picks 2 of the experts "
    "for every token. TorchFuser fuses the whole block: the router's top-k, the tokens sorted by expert, the experts "
    "as grouped GEMMs with SwiGLU, and the weighted combine, forward and backward, on the block's own stacked expert "
    "weights. Attention, the norms and the LM head around it are fused as in Llama.",
    f'cfg = AutoConfig.for_model("mixtral", {TINY}, num_local_experts=4, num_experts_per_tok=2)',
    "## The experts: one fused block per layer\n\nEach MoE block is now a `FusedMoE` holding the very expert and "
    "router parameters it had (the state_dict is unchanged). The report says what the probes found: the number of "
    "experts, top-k, the router's form and the activation.",
    '''
moe = [e for e in rep.entries if e.pattern == "moe"]
for e in moe:
    print(f"{e.name}: {e.original} -> {e.fused} ({e.backend})")
assert len(moe) == cfg.num_hidden_layers and all(e.is_fused for e in moe)
assert type(model.model.layers[0].mlp).__name__ == "FusedMoE"  # holding the parameters cell 3 checked are the same
assert rep.counts()["attention"]["fused"] == cfg.num_hidden_layers
''', batch=2, seq=64, steps=6)

import vlm_walkthrough  # noqa: E402  (09: a vision-language model, its own cells)

WALKTHROUGHS[vlm_walkthrough.NAME] = vlm_walkthrough.build(md, code, FUSE, PLOT)


def _select(names: list[str]) -> list[Path]:
    every = sorted(set(OUT.glob("*.ipynb")) | {OUT / n for n in WALKTHROUGHS})
    if not names:
        return every
    chosen = [p for p in every if any(p.name == n or p.name.startswith(n.rstrip("_") + "_") or p.stem == n for n in names)]
    if len(chosen) < len(names):
        sys.exit(f"unknown notebook in {names}; there are {[p.name for p in every]}")
    return chosen


def _executed(path: Path, fresh: dict) -> dict:
    """``fresh`` as committed: every cell with an id, no run-specific metadata."""
    for i, cell in enumerate(fresh["cells"]):
        cell.setdefault("id", f"{path.name[:2]}-{i:02d}")
    fresh["nbformat"], fresh["nbformat_minor"] = 4, max(5, fresh.get("nbformat_minor", 5))
    fresh["metadata"]["language_info"] = {"name": "python"}
    return fresh


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerates the notebooks (sources of 03-07, outputs of all).")
    ap.add_argument("names", nargs="*", help="notebooks to regenerate, by file name or number (default: all)")
    ap.add_argument("--sources-only", action="store_true", help="write the sources of 03-07 without outputs; run nothing")
    args = ap.parse_args(argv)
    paths = _select(args.names)
    for path in paths:
        if path.name in WALKTHROUGHS:
            nbrun.write(path, WALKTHROUGHS[path.name])
    if args.sources_only:
        return 0
    if nbrun.versions()["torch-mlir"] is None:
        # Outputs made without it name the reference backend, and the tests would compare them nowhere.
        sys.exit("torch-mlir is not installed: regenerate the outputs with the development install (pip install -e '.[dev]')")
    failed = []
    for path in paths:
        start = time.perf_counter()
        fresh = nbrun.execute(path)
        error = nbrun.first_error(fresh)
        if error:
            print(f"{path.name}: a cell failed, outputs not written\n{error}", file=sys.stderr)
            failed.append(path.name)
            continue
        nbrun.write(path, _executed(path, fresh))
        cells = sum(c["cell_type"] == "code" for c in fresh["cells"])
        print(f"{path.name}: {cells} code cells run and written ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
