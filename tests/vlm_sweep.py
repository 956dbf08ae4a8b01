"""Every image-text-to-text model type of the installed transformers, tiny and random, unfused against fused.

Each type of ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` gets a tiny config for both towers (the causal-LM
sweep's generic sizes, applied to every sub-config; images of ``patch_size·8`` pixels a side; special token ids
moved into the tiny vocabulary), random pixel values of a shape its forward takes (tried in turn: patches
flattened with a ``grid_thw`` as Qwen-VL's processor makes them, one image a row, one tile of one image a row),
and a batch of two rows with one image each whose image tokens sit where a processor puts them: one
contiguous run, as long as the model's own ``get_image_features`` makes features, after a short text prompt.
Labels are the tokens with image tokens -100. One fp32 training step on the CPU unfused and fused
(``backend="reference"``), and the type is classed as in ``arch_sweep``: ``fused`` (and exact), ``nothing``
(every candidate skipped, the report says why), ``unbuildable`` (no tiny config, or no input shape its
forward runs on), ``wrong`` or ``crash`` (failures).

``python tests/vlm_sweep.py [TYPES] [--readme]`` prints the table and rewrites the README's VLM table.
"""
from __future__ import annotations

import contextlib
import copy
import io
import inspect
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import arch_sweep  # noqa: E402
from vlm_configs import PATCHES, VOCAB, _first_int, _vision, tiny_config  # noqa: E402
from vlm_pixels import pixel_candidates, text_only  # noqa: E402

PROMPT, TAIL = 3, 5  # text tokens before and after the image


@dataclass
class Result(arch_sweep.Result):
    towers: dict[str, dict[str, int]] = field(default_factory=dict)  # tower → pattern → fused blocks


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def _model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])


def _get_image_features(model):
    for m in (model, getattr(model, "model", None)):
        fn = getattr(m, "get_image_features", None)
        if callable(fn):
            return fn
    # a vision-language model inside a model of another kind (PI0's robot policy: its PaliGemma)
    return next((m.get_image_features for m in model.modules() if callable(getattr(m, "get_image_features", None))), None)


def _feature_rows(out, width: int) -> int:
    stack = getattr(out, "deepstack_features", None)
    if getattr(out, "pooler_output", None) is None and isinstance(stack, (list, tuple)) and stack \
            and isinstance(stack[0], tuple) and len(stack[0]) == 2:
        out = stack[0][1]  # (text layer, features) pairs injected layer by layer (Granite 4 Vision): the first's rows
    elif hasattr(out, "pooler_output") and out.pooler_output is not None:
        out = out.pooler_output
    elif not isinstance(out, (torch.Tensor, list, tuple)) and hasattr(out, "to_tuple"):
        out = out.to_tuple()[0]
    tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    total = sum(t.numel() for t in tensors)
    if not tensors or total % width:
        raise ValueError(f"image features of {total} values are not rows of the text width {width}")
    return total // width


def _image_token(cfg) -> int | None:
    # the config's, its text config's, or a vision-language model's inside it (PI0's vlm_config)
    from transformers import PretrainedConfig

    subs = [v for k, v in vars(cfg).items() if isinstance(v, PretrainedConfig) and k != "text_config"]
    for sub in (cfg, getattr(cfg, "text_config", None), *subs):
        for name in ("image_token_id", "image_token_index", "image_token", "video_token_id", "video_token_index"):
            v = getattr(sub, name, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None  # the image reaches the model another way (an encoder-decoder, or features put before the text)


def _features(fn, kwargs: dict):
    """``fn``'s image features; where it takes no 5-D pixels, of them flattened to one image a camera or tile, as a
    model that takes several a row flattens them before its vision model (PI0's cameras)."""
    try:
        return fn(**kwargs)
    except Exception:
        px = kwargs.get("pixel_values")
        if not (isinstance(px, torch.Tensor) and px.dim() == 5):
            raise
        return fn(**{**kwargs, "pixel_values": px.flatten(0, 1)})


def _action_inputs(model, params, rows: int) -> dict:
    """A flow-matching robot policy's training inputs (PI0, PI0.5: ``actions`` its labels, an MSE loss on the velocity
    it predicts): the robot's state, the actions, and the noise and time the forward would otherwise draw itself."""
    cfg = model.config
    gen = torch.Generator().manual_seed(3)
    chunk, dim = cfg.chunk_size, cfg.max_action_dim
    out = {"actions": torch.randn(rows, chunk, dim, generator=gen), "noise": torch.randn(rows, chunk, dim, generator=gen),
           "timestep": torch.rand(rows, generator=gen) * 0.998 + 0.001}
    if "state" in params:
        out["state"] = torch.randn(rows, cfg.max_state_dim, generator=gen)
    return {k: v for k, v in out.items() if k in params}


def build_inputs(model, pixels: dict, rows: int = 2) -> dict:
    """input_ids with one image's tokens a row (as many as ``get_image_features`` makes), the pixel inputs,
    labels with image tokens -100, and the token-type masks the forward takes."""
    fn = _get_image_features(model)
    owner = getattr(fn, "__self__", model)  # the text width of the model whose features they are (PI0's PaliGemma)
    text = getattr(owner, "config", model.config).get_text_config()
    width = getattr(text, "hidden_size", None)
    image = _image_token(model.config)
    params = inspect.signature(type(model).forward).parameters
    slots = getattr(model.config, "latent_query_num", None)
    if image is None and "image_embeds_position_mask" in params and isinstance(slots, int):
        n = rows * slots  # Kosmos-2: the positions of a row's image features, marked by a mask, not by a token
    elif image is None:  # text alone in input_ids: the model puts the image in itself
        n = 0
    elif fn is None or not isinstance(width, int):
        n = rows  # cross-attention to the image (Mllama): one image token a row marks it
    else:
        takes = inspect.signature(fn).parameters
        open_ = any(p.kind is p.VAR_KEYWORD for p in takes.values())  # passed on to the inner model's (VideoLLaMA 3)
        kwargs = {k: v for k, v in pixels.items() if k in takes or open_}
        with torch.no_grad():
            n = _feature_rows(_features(fn, kwargs), width)
    if n % rows:
        raise ValueError(f"{n} image features do not split into {rows} images")
    gen = torch.Generator().manual_seed(1)
    specials = {v for v in range(VOCAB - 16, VOCAB)}
    specials |= {image}  # an image token id below the reserved top (Cosmos 3 Edge's) is never text
    body = [t for t in range(3, VOCAB) if t not in specials]
    ids = torch.tensor(body)[torch.randint(0, len(body), (rows, PROMPT + n // rows + TAIL), generator=gen)]
    if image is not None:
        ids[:, PROMPT:PROMPT + n // rows] = image
        bounds = [getattr(model.config, f"image_{e}_token_id", None) for e in ("start", "end")]
        if all(isinstance(t, int) for t in bounds):  # the image's run between its start and end tokens (Ovis 2.5)
            ids[:, PROMPT - 1], ids[:, PROMPT + n // rows] = bounds
    is_image = ids == image if image is not None else torch.zeros_like(ids, dtype=torch.bool)
    is_image[:, PROMPT:PROMPT + n // rows] = True
    labels = ids.masked_fill(is_image, -100)
    inputs = {"input_ids": ids, "labels": labels, **pixels}
    if "actions" in params and "labels" not in params:  # a robot policy: actions are its labels
        del inputs["labels"]
        inputs.update(_action_inputs(model, params, rows))
    if "bbox" in params:  # a layout model's word boxes (UDOP): each token in a box of its own, 0-1000 coordinates
        start = torch.arange(ids.shape[1]) * 1000 // ids.shape[1]
        inputs["bbox"] = torch.stack([start, start, start + 10, start + 10], -1).expand(rows, -1, -1).clone()
    if "image_embeds_position_mask" in params:
        inputs["image_embeds_position_mask"] = is_image.long()
    for name in ("token_type_ids", "mm_token_type_ids"):
        if name in params:
            inputs[name] = is_image.long()
    if "cross_attention_mask" in params and "aspect_ratio_mask" in pixels:  # every token sees its row's image tiles
        inputs["cross_attention_mask"] = pixels["aspect_ratio_mask"][:, None].expand(rows, ids.shape[1], -1, -1).clone()
    px = pixels.get("pixel_values")
    if "image_attention_mask" in params and px is not None and px.dim() == 5:  # cross-attention (IDEFICS): all see it
        inputs["image_attention_mask"] = torch.ones(rows, ids.shape[1], px.shape[1], dtype=torch.long)
    return inputs


def _step(model, inputs):
    torch.manual_seed(0)
    out = model(**{k: v.clone() for k, v in inputs.items()}, use_cache=False)
    loss = out.loss if not isinstance(out, tuple) else out[0]
    loss.backward()
    return loss.detach()


def grads_match(ref, fused, rel: float = 1e-4) -> str | None:
    """Every gradient within ``rel`` of the largest of its own tensor, with a floor at ``rel`` of the largest
    gradient norm of the model: a gradient that is zero in exact arithmetic (a bias before a norm) is rounding."""
    floor = rel * max((p.grad.norm().item() for p in ref.parameters() if p.grad is not None), default=0.0) + 1e-7
    for (name, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        if (a.grad is None) != (b.grad is None):
            return f"{name}: gradient {'missing' if b.grad is None else 'extra'} in the fused model"
        if a.grad is not None:
            tol = rel * a.grad.abs().max().item() + floor
            err = (a.grad - b.grad).abs().max().item()
            if not err <= tol:
                return f"{name}: gradient differs by {err:.3g} (tolerance {tol:.3g})"
    return None


def _decoder_prefix(model) -> str | None:
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return next((n for n, m in model.named_modules() if m is decoder), None) if decoder is not None else None


def _image_reached_loss(model, inputs) -> bool:
    """Whether the image reaches the loss: a parameter outside the language model got a nonzero gradient (in the
    step just run), or the loss changes with other random pixels (a vision tower inside the language model, GIT's)."""
    prefix = _decoder_prefix(model)
    if prefix is not None and any(p.grad is not None and p.grad.any() for n, p in model.named_parameters()
                                  if not n.startswith(prefix + ".") and "embed" not in n and "lm_head" not in n):
        return True
    other = {k: v.clone() for k, v in inputs.items()}
    gen = torch.Generator().manual_seed(9)
    if "pixel_values" in other:
        other["pixel_values"] = torch.randn(other["pixel_values"].shape, generator=gen)
    if "flattened_patches" in other:  # the pixels, not the patches' positions
        other["flattened_patches"][..., 2:] = torch.randn(other["flattened_patches"][..., 2:].shape, generator=gen)
    with torch.no_grad():
        torch.manual_seed(0)
        a = model(**{k: v.clone() for k, v in inputs.items()}, use_cache=False).loss
        torch.manual_seed(0)
        b = model(**other, use_cache=False).loss
    return not torch.equal(a, b)


def towers(model, rep) -> dict[str, dict[str, int]]:
    """Fused blocks per tower: ``text`` (under the language model, or the head on the model itself) and
    ``vision`` (everything else: the vision encoder and the projector)."""
    prefix = _decoder_prefix(model)
    out: dict[str, dict[str, int]] = {}
    for e in rep.fused:
        text = e.name == "" or e.pattern == "lm_head_loss" or (
            prefix is not None and (e.name == prefix or e.name.startswith(prefix + ".")))
        tower = out.setdefault("text" if text else "vision", {})
        tower[e.pattern] = tower.get(e.pattern, 0) + 1
    return out


def idle_heads(model, res: Result) -> None:
    """A fused LM head + loss that made no fused call in the step just run (an inner causal LM the model calls without
    labels, computing the loss from its logits itself where the model's own fused loss could not be probed: BLIP-2's;
    or one the model's own fused loss took over: Kosmos-2.5's) is not counted as fused; where none ran, the table
    gives the reason."""
    from torchfuser.modules.lm_head import FusedLMHeadLoss

    for name, m in model.named_modules():
        fused = m.__dict__.get("forward")
        if isinstance(fused, FusedLMHeadLoss) and fused.calls.n == 0:
            text = res.towers.get("text", {})
            text["lm_head_loss"] = text.get("lm_head_loss", 1) - 1
            if text["lm_head_loss"]:  # another fused head ran (the model's own, on the inner causal LM's head)
                continue
            del text["lm_head_loss"]
            res.skipped["lm_head_loss"] = (
                f"fused on {name!r} ({type(m).__name__}), which ran no fused call in the training step: the model "
                "calls it without labels and computes the loss from its logits itself, so its own head and loss run")


def run_one(model_type: str, vision: dict | None = None) -> Result:
    """The sweep of one type; ``vision``: fields set on its tiny vision config (a variant's switches)."""
    short = arch_sweep._short
    params = inspect.signature(_model_class(model_type).forward).parameters
    if not {"labels", "actions"} & set(params):
        return Result(model_type, "unbuildable", "inputs: its forward takes no labels and computes no loss (DiffusionGemma's "
                      "block diffusion: logits over a canvas, trained with a loss of the training loop's own)")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        inputs, loss_ref, why, tried = None, None, "no pixel input shape tried", False
        # A config that wants as many k/v heads as heads (no GQA), or a model that runs only so (Mistral Large 4's
        # text attention): so be it.
        for kv_as_heads in (False, True):
            try:
                cfg = tiny_config(model_type, kv_as_heads)
                for key, value in (vision or {}).items():
                    setattr(_vision(cfg), key, value)
                torch.manual_seed(0)
                ref = _model_class(model_type)._from_config(cfg).float().train()
            except Exception as err:
                # A config validator's own words, not its wrapper's (StrictDataclassClassValidationError); a missing
                # package's message from its first line with words (transformers' start with a newline)
                cause = err.__cause__ if err.__cause__ is not None and "Validation" in type(err).__name__ else err
                first = next((line for line in str(cause).splitlines() if line.strip()), "")
                if tried:  # the model was built before: its inputs are the reason
                    break
                if kv_as_heads or not ("num_key_value_heads" in first and "num_attention_heads" in first):
                    return Result(model_type, "unbuildable", f"config or model: {type(cause).__name__}: {first}"[:180])
                continue
            for pixels in pixel_candidates(ref, 2):
                try:
                    inputs = build_inputs(ref, pixels)
                    ref.zero_grad(set_to_none=True)
                    loss_ref = _step(ref, inputs)
                    break
                except Exception as err:
                    inputs, why = None, why if tried else short(err)
                    tried = True
            if inputs is not None:
                break
        if inputs is None:
            return Result(model_type, "unbuildable", "inputs: " + why)
        fused = copy.deepcopy(ref)
        if _image_token(ref.config) is None and not text_only(ref) and not _image_reached_loss(ref, inputs):
            return Result(model_type, "unbuildable", "inputs: with no image token id in its config, the pixels given "
                          "beside plain text do not reach the loss (no gradient outside its language model, the same "
                          "loss with other pixels): its image placeholders are not known here")
        def add_towers(res, model, rep):
            res.towers = towers(model, rep)

        res = Result(model_type, "")

        def step(m):
            loss = _step(m, inputs)
            idle_heads(m, res)
            return loss

        return arch_sweep.optimize_and_check(res, ref, fused, loss_ref, step, grads_match, add_towers)


def sweep(types=None) -> list[Result]:
    return [run_one(t) for t in (types or model_types())]


def _blocks(counts: dict[str, int]) -> str:
    return ", ".join(f"{p} {n}" for p, n in sorted(counts.items())) or "—"


def table(results: list[Result]) -> str:
    lines = ["| model type | result | text tower fused | vision tower fused | left alone (one reason a pattern) |",
             "|---|---|---|---|---|"]
    for r in results:
        if r.kind == "unbuildable":
            why = f"not built here: {r.detail}"
        elif r.failed:
            why = f"**{r.kind}**: {r.detail}"
        else:
            why = "; ".join(f"{p}: {w}" for p, w in sorted(r.skipped.items())) or "—"
        lines.append(f"| {r.model_type} | {r.kind} | {_blocks(r.towers.get('text', {}))} | "
                     f"{_blocks(r.towers.get('vision', {}))} | {why.replace('|', '/')} |")
    return "\n".join(lines)


summary = arch_sweep.summary
_BEGIN, _END = "<!-- vlm-sweep:begin -->", "<!-- vlm-sweep:end -->"


def write_readme(results: list[Result], path: Path) -> None:
    arch_sweep.write_block(path, (_BEGIN, _END), "tests/vlm_sweep.py", summary(results), table(results))


if __name__ == "__main__":
    args = sys.argv[1:]
    names = [a for a in args if not a.startswith("--")]
    results = []
    for t in names or model_types():
        r = run_one(t)
        results.append(r)
        print(f"{t:28s} {r.kind:12s} {r.towers} {r.detail}", flush=True)
    print(summary(results))
    if "--readme" in args:
        write_readme(results, Path(__file__).resolve().parents[1] / "README.md")
