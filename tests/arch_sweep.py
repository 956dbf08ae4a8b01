"""Every causal-LM model type of the installed transformers, tiny and random, unfused against fused.

Each type gets a tiny config made from its defaults by generic size fields (hidden 64, 2 layers, 4
heads, 4 experts of which 2 are active, vocabulary 128, every dropout 0), is trained one step on the
CPU in fp32 (``labels=input_ids``) unfused and fused (``backend="reference"``), and is classed:

- ``fused``: something was fused, and the loss and every gradient match the unfused model's;
- ``nothing``: no block matched or every candidate was skipped (the report says why); exact too;
- ``unbuildable``: the config or the plain model cannot be built or run on ``input_ids`` alone
  (a composite or audio model, an optional dependency missing): not TorchFuser's business;
- ``wrong``: a loss or gradient differs — a failure;
- ``crash``: ``optimize``, the fused step, ``restore`` or the report raised — a failure.

``python tests/arch_sweep.py`` prints the table; ``--readme`` rewrites the README's generated table.
"""
from __future__ import annotations

import contextlib
import copy
import io
import re
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a script: the torchfuser of this checkout, not an installed one
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torchfuser  # noqa: E402

VOCAB = 128
# Generic size fields of transformers' configs, by name: (names, tiny value).
_SIZES = [
    (("vocab_size", "encoder_hash_byte_group_vocab"), VOCAB),  # (BLT's hashed n-gram tables: 6 × 500002 rows)
    (("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "hidden_dim", "word_embed_proj_dim",
      "embedding_size", "d_embed", "hidden_size_global", "adapter_in_dim", "adapter_input_size", "adapter_out_dim"),
     64),
    (("intermediate_size", "ffn_dim", "decoder_ffn_dim", "encoder_ffn_dim", "n_inner", "d_ff", "ffn_hidden_size",
      "d_inner"), 128),
    (("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
      "num_decoder_layers", "num_encoder_layers"), 2),
    (("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
      "num_heads", "n_attn_heads"), 4),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_kv"), 2),
    (("head_dim", "kv_channels", "attention_head_size", "v_head_dim"), 16),
    (("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "num_selected_experts", "moe_k", "top_k", "num_experts_per_token"), 2),
    (("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    (("n_group", "topk_group", "num_expert_group"), 1),
    (("n_shared_experts",), 1),  # (dots1's default is None, and the shared expert's width is a multiple of it)
    (("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim"), 8),
    (("q_lora_rank",), 16),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length"), 128),
    (("mamba_chunk_size",), 16),  # (Bamba's 256 in transformers 5.17: a 17 GB intermediate on the CPU)
    # Gemma 3n's and 4's per-layer inputs: a (262144, layers · 256) embedding by default, 0.5 GB in fp32
    (("vocab_size_per_layer_input",), VOCAB),
    (("hidden_size_per_layer_input",), 16),
    # Qwen4-Exp's sparse-attention indexer: its layer_types name indexed layers but the fields default to None
    (("indexer_n_heads",), 4), (("indexer_kv_heads",), 1), (("indexer_head_dim",), 16),
    (("indexer_budget",), 8), (("indexer_compress_ratio",), 4),
]
_SIZE = {name: value for names, value in _SIZES for name in names}
SEQ = 12


@dataclass
class Result:
    model_type: str
    kind: str  # fused | nothing | unbuildable | wrong | crash
    detail: str = ""
    fused: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # pattern → one reason

    @property
    def failed(self) -> bool:
        return self.kind in ("wrong", "crash")


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_LAYERS = _SIZES[3][0]
# Types whose configs tie fields together beyond generic sizes.
_EXTRA = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "mamba2": dict(num_heads=8),  # heads · head_dim = expand · hidden
    "codegen": dict(rotary_dim=8), "gptj": dict(rotary_dim=8),
    "dory": dict(n_input_layers=2, n_recurrent_layers=0, n_output_layers=2, num_hidden_layers=4,
                 layer_types=["sliding_attention", "mlp", "full_attention", "mlp"]),  # the three must sum up
    # DBRX's attention reads a rope_theta its config does not define, and clamps by clip_qkv, which cannot stay
    # None (its checkpoints: 8)
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),
    # rotary parameters by layer type, and its defaults name none of them
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dots3_note_text": dict(head_dim=16),  # its sliding layers: head_dim = qk_nope_head_dim + qk_rope_head_dim
    # no default layout (LFM2's derives one); the first num_dense_layers have a dense MLP, the others experts
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # Kolibri's lists of layer indices (whose keys and values a layer reads, which indexed layers select keys)
    # derived again from the kept layer_types, one dense MLP layer, at most as many index heads as a key head has
    # query heads
    "kolibri1_1": dict(num_hidden_layers=2, kv_source_layers=None, index_layers=None, mlp_only_layers=[0],
                       index_num_heads=2),
    "zaya": dict(num_experts_per_tok=1),  # the only routing it supports
    "xmod": dict(default_language="en_XX"),  # the adapter its layers run (one of its config's languages)
    # Zamba's hybrid layers share one attention block, tied by a pattern that needs two of them; its attention
    # widths and the Mamba rank derived again from the tiny hidden_size (the defaults' are for 3712)
    "zamba": dict(layers_block_type=["linear_attention", "hybrid", "hybrid"], num_hidden_layers=3,
                  attention_hidden_size=None, attention_head_dim=None, mamba_dt_rank="auto"),
}


def _per_layer(values: list, n_layers: int):
    """A per-layer list shortened to a few layers that keep each kind it names (attention and
    recurrent layers of a hybrid, sliding and full attention...)."""
    kinds = list(dict.fromkeys(v if not isinstance(v, list) else tuple(v) for v in values))
    kinds = [list(k) if isinstance(k, tuple) else k for k in kinds][:4]
    return (kinds * 2)[:max(2, len(kinds))]


def _tiny(values: dict) -> dict:
    """Overrides for one config's fields: sizes by name, every dropout 0, per-layer lists cut to the
    few layers kept, sub-configs likewise."""
    out = {}
    n_layers = next((values[k] for k in _LAYERS if isinstance(values.get(k), int)), None)
    for key, value in values.items():
        if isinstance(value, dict) and ("model_type" in value or key.endswith("_config")) and "layer" not in key:
            out[key] = {**value, **_tiny(value)}
        elif isinstance(value, bool):
            continue
        elif key in _SIZE and (value is None or isinstance(value, int)):
            out[key] = _SIZE[key]
        elif isinstance(value, float) and ("drop" in key or "jitter" in key):
            out[key] = 0.0
        elif (isinstance(value, list) or isinstance(value, str) and "pattern" in key) and n_layers and n_layers > 2 \
                and len(value) == n_layers and key not in _SIZE:
            short = _per_layer(list(value), n_layers)
            out[key] = "".join(short) if isinstance(value, str) else short
            for k in _LAYERS:
                if k in values:
                    out[k] = len(short)
    per_layer = next(((list(values[k]), v) for k, v in out.items() if isinstance(v, list) and k in values
                      and isinstance(values[k], list) and len(values[k]) == n_layers), None)
    for key, value in values.items():  # indices into the default depth → the kept layers of the same kinds
        if per_layer and key.endswith(("_layer_ids", "_layer_indices", "per_layer_config")) and isinstance(value, (list, dict)):
            old, short = per_layer
            first = {}
            for i in value:  # (a dict's keys may be digits: "02", as to_dict writes them)
                index = int(i) if isinstance(i, str) and i.isdigit() else i
                if isinstance(index, int) and index < len(old):
                    first.setdefault(str(old[index]), i)
            kept = [j for j, kind in enumerate(short) if str(kind) in first]
            if isinstance(value, dict):  # a layer's own fields, sized as the config's
                out[key] = {j: {**(v := value[first[str(short[j])]]), **_tiny(v)} for j in kept}
            else:
                out[key] = kept
    for key, value in values.items():  # a size given layer by layer (Gemma 3n's intermediate_size): each the tiny one
        if key in _SIZE and isinstance(value, list) and n_layers and len(value) == n_layers:
            out[key] = [_SIZE[key]] * next((out[k] for k in _LAYERS if k in out), n_layers)
    shared = values.get("num_kv_shared_layers")
    if per_layer and isinstance(shared, int) and shared > 0:
        # the last layers reuse the caches of the last earlier layer of their kind: every kind must be kept before
        # them, so the kept layers come twice and the second copy shares (all of them where every layer does)
        short = per_layer[1]
        out["num_kv_shared_layers"] = len(short)
        if shared < n_layers:
            for key, value in list(out.items()):
                if isinstance(value, (list, str)) and isinstance(values.get(key), type(value)) \
                        and len(values[key]) == n_layers:
                    out[key] = value + value
            for k in _LAYERS:
                if k in values:
                    out[k] = 2 * len(short)
    if any(k in values for k in ("qk_rope_head_dim", "qk_nope_head_dim", "kv_lora_rank")) \
            and "num_key_value_heads" in out and values["num_key_value_heads"] == values.get("num_attention_heads"):
        # multi-head latent attention expands the latent into every query head: as many key/value heads
        out["num_key_value_heads"] = out.get("num_attention_heads", values["num_attention_heads"])
    return out


def tiny_config(model_type: str):
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    overrides = _tiny(defaults)
    if "qk_rope_head_dim" in defaults:  # multi-head latent attention: the rotary width is the head_dim
        overrides["head_dim"] = overrides["qk_rope_head_dim"]
    for key, value in _EXTRA.get(model_type, {}).items():  # a sub-config's entries go into its tiny fields
        overrides[key] = {**overrides[key], **value} if isinstance(overrides.get(key), dict) else value
    overrides.pop("attention_layers", None)  # GPT-Neo derives it from attention_types
    cfg = AutoConfig.for_model(model_type, **overrides)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        for sub in (cfg, getattr(cfg, "text_config", None)):
            if isinstance(getattr(sub, name, None), int) and getattr(sub, name) >= VOCAB:
                setattr(sub, name, 0)
    return cfg


def _step(model, ids):
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    loss = out.loss if not isinstance(out, tuple) else out[0]
    loss.backward()
    return loss.detach()


def _grads_match(ref, fused) -> str | None:
    for (name, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        if (a.grad is None) != (b.grad is None):
            return f"{name}: gradient {'missing' if b.grad is None else 'extra'} in the fused model"
        if a.grad is not None:
            tol = 1e-4 * a.grad.abs().max().item() + 1e-6
            err = (a.grad - b.grad).abs().max().item()
            if not err <= tol:
                return f"{name}: gradient differs by {err:.3g} (tolerance {tol:.3g})"
    return None


def _short(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    return text[:160]


def run_one(model_type: str) -> Result:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            cfg = tiny_config(model_type)
            torch.manual_seed(0)
            ref = AutoModelForCausalLM.from_config(cfg).float().train()
            ids = torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
            fused = copy.deepcopy(ref)
            loss_ref = _step(ref, ids)
        except Exception as err:
            return Result(model_type, "unbuildable", _short(err))
        return optimize_and_check(Result(model_type, ""), ref, fused, loss_ref, lambda m: _step(m, ids), _grads_match)


def optimize_and_check(res: Result, ref, fused, loss_ref, step, grads_match, extra=None) -> Result:
    """``optimize`` on ``fused`` (a copy of ``ref``, whose step gave ``loss_ref``), then the checks, shared with
    the VLM sweep: the global generator where it was, the ``state_dict`` keys, one training step
    (``step(model) -> loss``) against the unfused one's loss and gradients, then ``restore``. ``res`` is filled
    in; ``extra(fused, report)`` sets more of its fields."""
    keys = list(fused.state_dict())
    rng = torch.get_rng_state()
    try:
        torchfuser.optimize(fused, backend="reference")
        rep = torchfuser.report(fused)
    except Exception as err:
        return _fail(res, "crash", "optimize: " + _short(err) + _where(err))
    res.fused = {p: c["fused"] for p, c in rep.counts().items() if c["fused"]}
    for e in rep.skipped:
        res.skipped.setdefault(e.pattern, e.reason)
    res.kind = "fused" if res.fused else "nothing"
    if extra is not None:
        extra(res, fused, rep)
    moved_rng = not torch.equal(rng, torch.get_rng_state())
    if list(fused.state_dict()) != keys:
        return _fail(res, "wrong", "state_dict keys changed")
    try:
        loss = step(fused)
    except Exception as err:
        return _fail(res, "crash", "fused step: " + _short(err) + _where(err))
    if not torch.allclose(loss, loss_ref, rtol=1e-5, atol=1e-6):
        return _fail(res, "wrong", f"loss {loss.item():.6g}, unfused {loss_ref.item():.6g}")
    if why := grads_match(ref, fused):
        return _fail(res, "wrong", why)
    try:
        torchfuser.restore(fused)
    except Exception as err:
        return _fail(res, "crash", "restore: " + _short(err))
    if any(isinstance(m, torchfuser.modules.base.FusedModule) for m in fused.modules()):
        return _fail(res, "crash", "restore left fused modules behind")
    if moved_rng:
        return _fail(res, "crash", "optimize moved the global CPU random generator")
    return res


def _fail(res: Result, kind: str, detail: str) -> Result:
    res.kind, res.detail = kind, detail
    return res


def _where(err: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "torchfuser" in f.filename]
    return f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def sweep(types=None) -> list[Result]:
    return [run_one(t) for t in (types or model_types())]


def table(results: list[Result]) -> str:
    """The Markdown table of the README's architectures section."""
    lines = ["| model type | result | fused blocks | left alone (one reason a pattern) |", "|---|---|---|---|"]
    for r in results:
        fused = ", ".join(f"{p} {n}" for p, n in r.fused.items()) or "—"
        if r.kind == "unbuildable":
            why = f"not built here: {r.detail}"
        elif r.failed:
            why = f"**{r.kind}**: {r.detail}"
        else:
            why = "; ".join(f"{p}: {w}" for p, w in r.skipped.items()) or "—"
        lines.append(f"| {r.model_type} | {r.kind} | {fused} | {why.replace('|', '/')} |")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    from collections import Counter

    c = Counter(r.kind for r in results)
    return ", ".join(f"{k} {c[k]}" for k in ("fused", "nothing", "unbuildable", "wrong", "crash")) + f" of {len(results)}"


_BEGIN, _END = "<!-- arch-sweep:begin -->", "<!-- arch-sweep:end -->"


def write_readme(results: list[Result], path: Path) -> None:
    write_block(path, (_BEGIN, _END), "tests/arch_sweep.py", summary(results), table(results))


def write_block(path: Path, markers: tuple[str, str], script: str, summary_line: str, table_text: str) -> None:
    """The generated table between ``markers`` in ``path`` (appended where they are missing)."""
    import transformers

    begin, end = markers
    text = path.read_text()
    body = (f"{begin}\nGenerated by `python {script} --readme` with transformers {transformers.__version__}: "
            f"{summary_line}.\n\n{table_text}\n{end}")
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: body, text, flags=re.S)
    else:
        text += "\n" + body + "\n"
    path.write_text(text)


if __name__ == "__main__":
    args = sys.argv[1:]
    readme = "--readme" in args
    names = [a for a in args if not a.startswith("--")]
    results = []
    for t in names or model_types():
        r = run_one(t)
        results.append(r)
        print(f"{t:28s} {r.kind:12s} {r.fused} {r.detail}", flush=True)
    print(summary(results))
    if readme:
        write_readme(results, Path(__file__).resolve().parents[1] / "README.md")
