"""The vision-language walkthrough (09_qwen2_5_vl.ipynb): a tiny Qwen2.5-VL-shaped model on the CPU, both towers
fused, the loss and every gradient against the unfused model, eager against fused timed, the report per tower.
Its sources are written by make_walkthroughs.py (``build``), its outputs by the same run as the others'."""

NAME = "09_qwen2_5_vl.ipynb"
TITLE = "Qwen2.5-VL (vision-language)"

SETUP = '''
import copy
import logging
import torch
logging.disable(logging.WARNING)  # this import loads optional libraries that log about their missing GPU builds
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
logging.disable(logging.NOTSET)
import torchfuser
from torchfuser.modules.base import FusedModule

torch.manual_seed(0)
IMAGE, VIDEO, START, END = 1000, 1001, 1002, 1003  # special token ids inside the tiny vocabulary
text = dict(vocab_size=1024, bos_token_id=1, eos_token_id=2, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
# Two vision blocks: one windowed (attention within 56-pixel windows), one full (fullatt_block_indexes).
vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
              fullatt_block_indexes=[1], window_size=56)
cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                       vision_start_token_id=START, vision_end_token_id=END, attn_implementation="sdpa")
BATCH, SEQ, STEPS, TITLE = 2, 64, 6, __TITLE__
model = Qwen2_5_VLForConditionalGeneration(cfg).float()
reference = copy.deepcopy(model)  # the untouched original, for comparison
print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters")
'''

INPUTS = '''
# One 112 x 112 image per row: 8 x 8 patches of 14 pixels (2 frames of a still image, as Qwen2.5-VL's processor
# makes them), merged 2 x 2 into 16 image tokens; then text. The image tokens are masked in the labels (-100),
# as a collator should: nothing to predict there.
gen = torch.Generator().manual_seed(1)
grid = torch.tensor([[1, 8, 8]] * BATCH)
patch = 3 * 2 * 14 * 14  # channels x frames x patch pixels
pixel_values = torch.randn(int(grid.prod(-1).sum()), patch, generator=gen)
image_tokens = 8 * 8 // 4
text_ids = torch.randint(3, 900, (BATCH, SEQ - image_tokens - 2), generator=gen)
ids = torch.cat([torch.full((BATCH, 1), START), torch.full((BATCH, image_tokens), IMAGE),
                 torch.full((BATCH, 1), END), text_ids], dim=1)
labels = ids.masked_fill(ids == IMAGE, -100)
batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixel_values, image_grid_thw=grid,
             labels=labels)
print({k: tuple(v.shape) for k, v in batch.items()})
'''

TOWERS = '''
by_tower = {}
for e in rep.entries:
    tower = "vision" if ".visual." in f".{e.name}." else "text"
    if e.is_fused:
        by_tower.setdefault(tower, {}).setdefault(e.pattern, 0)
        by_tower[tower][e.pattern] += 1
for tower, counts in by_tower.items():
    print(tower, dict(sorted(counts.items())))
attn = model.model.visual.blocks[0].attn
s = attn.spec
print(f"{type(attn).__name__}: {s.layout} {s.qkv}, {s.num_heads} heads of {s.head_dim}, rotary {s.rotary}, out {s.out!r}")
assert by_tower["vision"]["varlen_attention"] == cfg.vision_config.depth
assert by_tower["text"]["lm_head_loss"] == 1 and by_tower["text"]["attention"] == cfg.text_config.num_hidden_layers
'''

CHECK = '''
def loss_and_grads(m):
    m.zero_grad(set_to_none=True)
    loss = m(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

loss, grads = loss_and_grads(model)
loss_ref, grads_ref = loss_and_grads(reference)
assert list(grads) == list(grads_ref)  # every parameter got a gradient in both, under the same name
assert any(".visual." in n for n in grads)  # the vision tower's too
rel = {n: ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item() for n, g in grads_ref.items()}
worst = max(rel, key=rel.get)
assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref) and rel[worst] < 1e-4, (loss, loss_ref, worst, rel[worst])
print(f"loss {loss:.4f} fused vs {loss_ref:.4f} original: the same within 1e-5 (relative)")
print(f"{len(rel)} gradients compared (both towers): each the same within 1e-4 of its largest entry")
'''

TIME = '''
import time

def train_step(m):
    m.zero_grad(set_to_none=True)
    m(**batch).loss.backward()

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
best = {k: min(v) for k, v in times.items()}
print(f"forward + backward, batch {BATCH} x ({image_tokens} image + {SEQ - image_tokens} text tokens), fp32, "
      f"{torch.get_num_threads()} CPU threads, fastest of {STEPS} steps:")
for k, v in best.items():
    print(f"  {k:>10}: {v:7.1f} ms")
print(f"  speed-up: {best['eager'] / best['torchfuser']:.2f}x  (this run, this CPU)")
'''

RESTORE = '''
torchfuser.restore(model)
assert not any(isinstance(m, FusedModule) for m in model.modules())
assert list(model.state_dict()) == keys_before
loss_back, _ = loss_and_grads(model)
print(f"restored: {type(model).__name__} of plain transformers modules, loss {loss_back:.4f}")
assert abs(loss_back - loss_ref) <= 1e-5 * abs(loss_ref)
'''


def build(md, code, fuse: str, plot: str) -> dict:
    """The notebook without outputs (md / code: make_walkthroughs' cell makers; fuse, plot: its shared cells)."""
    fill = lambda s: s.replace("__TITLE__", repr(TITLE))  # noqa: E731
    cells = [
        md(f"# {TITLE} with TorchFuser\n\nA vision-language model is two towers: a vision encoder (here Qwen2.5-VL's: "
           "patches of every image in one unbatched sequence, attention within each image or window given by "
           "`cu_seqlens`, windowed and full layers) and a language model that reads the image's tokens among the "
           "text's. `optimize` fuses both with the same structural patterns, and the LM head + loss on the outer "
           "`...ForConditionalGeneration`.\n\nEverything runs on the CPU in seconds, with random weights and no "
           "downloads. The timings are what this run measured on the machine that executed the notebook (a small CPU, "
           "a tiny model): they show how to measure, not what a GPU gains. `benchmarks/vlm_step.py` measures real sizes."),
        code(fill(SETUP)),
        md("## A batch\n\nWhat Qwen2.5-VL's processor makes from two images and their captions: flattened patches, "
           "each image's grid, and the token sequence with the image's placeholder tokens."),
        code(fill(INPUTS)),
        md("## Fuse\n\n`optimize` swaps blocks in place and returns the model. The report lists every candidate "
           "block: fused (with the backend) or skipped (with the reason)."),
        code(fuse),
        md("## Both towers\n\nThe fused blocks per tower. The vision attention runs over `cu_seqlens` "
           "(`varlen_attention`: one variable-length attention call on a GPU instead of a Python loop over images "
           "and windows); the text tower is fused as a text model is."),
        code(fill(TOWERS)),
        md("## Same loss, every gradient the same\n\nOne training step of the fused model against the untouched "
           "copy, in fp32. Every parameter's gradient is compared, the vision tower's included."),
        code(fill(CHECK)),
        md("## Eager against fused\n\nA few forward + backward steps of each, after one warm-up step. The fastest "
           "step of each is the figure. On a tiny model on a CPU the fused kernels can lose to eager; that is a "
           "measurement, not a promise either way."),
        code(fill(TIME)),
        code(plot),
        md("## Undo\n\n`restore` puts the original modules back; the parameters never moved."),
        code(fill(RESTORE)),
    ]
    nb = {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                                        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}
    for i, c in enumerate(nb["cells"]):
        c["id"] = f"{NAME[:2]}-{i:02d}"
    return nb
