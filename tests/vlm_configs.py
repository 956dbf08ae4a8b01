"""Tiny configs for both towers of an image-text-to-text model type, for tests/vlm_sweep.py: the causal-LM
sweep's generic sizes applied to every sub-config, images of ``patch_size·8`` pixels a side, vision depth 2
(layer indices mapped into it), the widths a vision tower hands the language model set to the text width,
multimodal rotary sections rescaled, and special token ids moved into the tiny vocabulary."""
from __future__ import annotations

import re

import arch_sweep

VOCAB = arch_sweep.VOCAB
PATCHES = 8  # patches a side of a tiny image
_TOKEN_ID = re.compile(r"(_token_id|_token_index|_token_ids|_patch_id)$")  # Molmo 2's image token: image_patch_id
# Vision fields tied to the number of patches a side: tokens after pooling (Gemma 3), image sequence lengths.
_PER_IMAGE = ("mm_tokens_per_image", "latent_query_num")
# Widths of what a vision tower hands the language model: the text width.
_TO_TEXT = ("out_hidden_size", "text_hidden_size", "output_hidden_size", "projection_dim", "out_hidden_dim",
            "vision_output_dim", "projector_input_dim", "projector_output_dim", "projection_hidden_size",
            "vision_hidden_size",  # these two: the vision tower's own width (Kimi-K2.5, Nemotron-H Omni), 64 too
            "decoder_hidden_size",  # an encoder's width as its decoder reads it (PP-FormulaNet's cross-attention)
            "adapter_out_dim")  # an adapter's output (Dots 3's vision and audio adapters)


def _is_sub(key, value) -> bool:
    """Whether ``value`` is a sub-config (not a per-layer table, whose keys are layer indices)."""
    return isinstance(value, dict) and key != "per_layer_config" and ("model_type" in value or str(key).endswith("_config"))


def _images(values: dict) -> dict:
    """Small images in every (sub-)config with a patch size: ``PATCHES`` patches a side."""
    out = {}
    for key, value in values.items():
        if _is_sub(key, value):
            out[key] = {**value, **_images(value)}
    patch = values.get("patch_size")
    patch = patch[0] if isinstance(patch, (list, tuple)) and patch else patch
    if isinstance(patch, int) and isinstance(values.get("image_size"), (int, list, tuple)):
        size = patch * PATCHES
        out["image_size"] = [size, size] if isinstance(values["image_size"], (list, tuple)) else size
        side = values["image_size"][0] if isinstance(values["image_size"], (list, tuple)) else values["image_size"]
        if values.get("num_position_embeddings") == (side // patch) ** 2:  # one a patch, fixed (Molmo 2's)
            out["num_position_embeddings"] = PATCHES**2
    if isinstance(values.get("image_grid_pinpoints"), list):  # any-resolution tiling: one tile of the tiny size
        vis = values.get("vision_config") or {}
        p, s = vis.get("patch_size", 14), vis.get("image_size")
        side = (p[0] if isinstance(p, list) else p) * PATCHES if isinstance(p, (int, list)) and s else None
        if side:
            out["image_grid_pinpoints"] = [[side, side]]
    for key, value in values.items():  # hidden-state taps (LLaVA's vision_feature_layer(s)) within the tiny depth
        if key.endswith(("feature_layer", "feature_layers")):
            if isinstance(value, int) and not -3 <= value < 3:
                out[key] = -1
            elif isinstance(value, list) and value and all(isinstance(i, int) and i >= 0 for i in value):
                out[key] = sorted({min(i, 1) for i in value})  # layers counted from the first (Molmo 2's adapter)
            elif isinstance(value, list) and all(isinstance(i, int) for i in value):
                out[key] = sorted({max(-3, min(2, i)) for i in value})
    if isinstance(values.get("depth"), int) and values["depth"] > 2:  # vision layers (Qwen-VL's towers)
        out["depth"] = 2
        for key, value in values.items():  # layer indices (full-attention layers, deepstack taps) → the two kept
            if key.endswith(("indexes", "indices")) and isinstance(value, list) and all(isinstance(i, int) for i in value):
                out[key] = sorted({min(i, 1) for i in value})
    if isinstance(values.get("qk_rope_head_dim"), int) and "head_dim" in values:  # latent attention: as arch_sweep
        out["head_dim"] = values["qk_rope_head_dim"]
    for key, tiny in (("layers", 2), ("attention_heads", 4)):  # Kosmos-2's text config names them so
        if isinstance(values.get(key), int) and not isinstance(values[key], bool) and values[key] > tiny:
            out[key] = tiny
    depth = values.get("num_hidden_layers")
    if isinstance(depth, int) and depth <= 2:  # hidden-state taps past the tiny depth (Mllama's intermediate layers)
        for key, value in values.items():
            if key.endswith(("indexes", "indices")) and isinstance(value, list) and value \
                    and all(isinstance(i, int) and not isinstance(i, bool) for i in value) and max(value) >= depth:
                out[key] = sorted({min(i, depth - 1) for i in value})
        taps = out.get("intermediate_layers_indices", values.get("intermediate_layers_indices"))
        if isinstance(taps, list) and isinstance(values.get("vision_output_dim"), int):
            # Mllama hands on the last hidden state and every tapped one, concatenated
            out["vision_output_dim"] = values["hidden_size"] * (1 + len(taps))
        if isinstance(values.get("num_global_layers"), int) and values["num_global_layers"] > 2:
            out["num_global_layers"] = 2  # a second stack of layers (Mllama's global encoder)
    ratio = values.get("pixel_shuffle_ratio")
    if isinstance(ratio, float) and 0 < ratio < 1 and "intermediate_size" in values:  # Llama 4: MLP in = shuffled width
        out["intermediate_size"] = int(arch_sweep._SIZE["hidden_size"] / ratio**2)
    down = values.get("downsample_channels")
    if isinstance(down, list) and down and all(isinstance(c, int) for c in down):  # a SAM feature map handed on as
        width = arch_sweep._SIZE["hidden_size"]  # the next encoder's patch embeddings (Unlimited-OCR): its width
        out["downsample_channels"] = [max(1, width >> (len(down) - 1 - i)) for i in range(len(down))]
    if isinstance(values.get("unpadded_vocab_size"), int):  # a head narrower than the padded vocabulary (Inkling 2)
        out["unpadded_vocab_size"] = VOCAB - 16  # text tokens only: the ids above are the sweep's special ones
    if isinstance(values.get("d_kv"), int):  # T5-style head width (Pix2Struct's): heads · d_kv is the hidden width
        out["d_kv"] = arch_sweep._SIZE["head_dim"]
    for key in _TO_TEXT:
        if isinstance(values.get(key), int) and key not in out:
            out[key] = arch_sweep._SIZE["hidden_size"]
    for key in _PER_IMAGE:
        if isinstance(values.get(key), int):
            out[key] = (PATCHES // 2) ** 2
    for key, value in values.items():  # patches an image → its query tokens (Aria's projector): the tiny image's
        if key.endswith("patch_to_query_dict") and isinstance(value, dict) and value:
            out[key] = {PATCHES**2: (PATCHES // 2) ** 2}
    return out


def _sections(values: dict, factor: float = 1.0, rope_dim: int | None = None) -> dict:
    """Multimodal rotary sections (``mrope_section``, in any nested dict) rescaled to the tiny half rotary width."""
    out = {}
    factor = values.get("partial_rotary_factor") if isinstance(values.get("partial_rotary_factor"), float) else factor
    # multi-head latent attention rotates a width of its own (HY-V4-VL)
    rope_dim = values["qk_rope_head_dim"] if isinstance(values.get("qk_rope_head_dim"), int) else rope_dim
    half = (rope_dim if isinstance(rope_dim, int) else int(arch_sweep._SIZE["head_dim"] * factor)) // 2
    for key, value in values.items():
        if isinstance(value, dict):
            inner = _sections(value, factor, rope_dim)
            if inner:
                out[key] = {**value, **inner}
        elif isinstance(key, str) and key.endswith("section") and isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            scaled = [max(1, v * half // sum(value)) for v in value]
            scaled[-1] += half - sum(scaled)
            out[key] = scaled
    return out


def _stages(values: dict, defaults: dict) -> dict:
    """Per-layer lists left longer than the tiny depth (a hierarchical tower's per-stage patch sizes and widths
    that the causal-LM sweep keeps one per kind: Muse Spark's audio tower) cut to its first stages; shorter ones
    (Mistral Large 4's attention kinds, the depth set by its MLP kinds) padded with their last entry."""
    out = {}
    for key, value in values.items():
        if _is_sub(key, value) and isinstance(defaults.get(key), dict):
            inner = _stages(value, defaults[key])
            if inner:
                out[key] = {**value, **inner}
    n, n0 = values.get("num_hidden_layers"), defaults.get("num_hidden_layers")
    if isinstance(n, int) and isinstance(n0, int) and n < n0:
        for key, value in values.items():
            if isinstance(value, list) and len(value) == n0 and len(defaults.get(key) or ()) == n0:
                out[key] = value[:n]
            elif isinstance(value, list) and value and len(value) < n and len(defaults.get(key) or ()) == n0:
                out[key] = value + value[-1:] * (n - len(value))  # one kept per kind, the depth set by another list
    return out


def _merged_widths(values: dict, defaults: dict) -> dict:
    """A top-level width that is the vision width times merge² by default (the merged patches a projector reads:
    Muse Spark's and Muse Glimmer's out_hidden_size) stays so at the tiny widths."""
    vis0, vis = defaults.get("vision_config"), values.get("vision_config")
    if not (isinstance(vis0, dict) and isinstance(vis, dict)):
        return {}
    merge = next((vis0[k] for k in ("spatial_merge_size", "merge_size") if isinstance(vis0.get(k), int)), None)
    if not merge or not isinstance(vis0.get("hidden_size"), int) or not isinstance(vis.get("hidden_size"), int):
        return {}
    return {k: vis["hidden_size"] * merge**2 for k in _TO_TEXT
            if isinstance(defaults.get(k), int) and defaults[k] == vis0["hidden_size"] * merge**2}


_LATENT = ("qk_nope_head_dim", "qk_rope_head_dim")


# Fields a config leaves None (or sized for its checkpoint's depth) that its model needs, set by its checkpoints.
# Granite 4 Vision: Window Q-Former projectors (2×2 queries over 4×4 patch windows, as the 2×2 spatial groups sample),
# one deepstack tap (the vision tower's second-last hidden state into the first text layer) and the four spatial
# groups into the second (the last one written wins, as in the model's own dict of injections).
_FILLED = {"granite4_vision": {"downsample_rate": "2/4", "deepstack_layer_map": [[-2, 0]],
                               "spatial_target_layers": [1, 1, 1, 1]}}


def _tied(values: dict, defaults: dict) -> dict:
    """Fields the defaults tie to others kept so at the tiny sizes, in every sub-config and per-layer table entry:
    a head width that is the latent attention's no-rotary plus rotary widths (Mistral 4's head_dim and qk_head_dim,
    Dots 3's sliding layers'), a codebook as wide as the encoder (WavTokenizer: no projections around its quantizer)
    and an adapter's input too (Dots 3's),
    and a size the defaults turn off with 0 (GLM-5-Next's NoPE DSA layers: qk_rope_head_dim 0). (Qwen4-Exp's
    indexer fields, None by default, are sizes of ``arch_sweep._SIZES``.)"""
    out = {}
    for key, value in values.items():
        if _is_sub(key, value) and isinstance(defaults.get(key), dict):
            inner = _tied(value, defaults[key])
            if inner:
                out[key] = {**value, **inner}
        elif key == "per_layer_config" and isinstance(value, dict) and isinstance(defaults.get(key), dict):
            table = {}
            for i, entry in value.items():  # an entry holds what differs from the config, at its default values
                # its head counts, latent ranks and widths made tiny as the config's are (not its head_dim: a global
                # layer's wider head, Gemma 4's, stays); the widths tied as in the default entry of its fields
                # (arch_sweep._tiny has moved the entries to the kept layers' indices, their sizes tiny already)
                default = next((e for e in defaults[key].values() if isinstance(e, dict) and e.keys() == entry.keys()),
                               entry)
                sizes = {k: arch_sweep._SIZE[k] for k, v in entry.items() if k in arch_sweep._SIZE and k != "head_dim"
                         and isinstance(v, int) and not isinstance(v, bool) and v}
                table[i] = {**entry, **sizes, **_widths({**values, **entry, **sizes}, {**defaults, **default})}
            out[key] = table
    out.update(_widths(values, defaults))
    for key, value in values.items():  # a codebook or an adapter's input as wide as the encoder by default
        if (key == "codebook_dim" or str(key).startswith("adapter_in")) and isinstance(value, int) \
                and defaults.get(key) == defaults.get("hidden_size") and isinstance(values.get("hidden_size"), int):
            out[key] = values["hidden_size"]
    for key, value in defaults.items():
        if key in arch_sweep._SIZE and value == 0 and not isinstance(value, bool) and values.get(key) != 0:
            out[key] = 0
    return out


def _widths(values: dict, defaults: dict) -> dict:
    """Head widths that are the no-rotary plus rotary widths by default, at the tiny ones (0 kept 0: NoPE)."""
    if not all(isinstance(defaults.get(k), int) and isinstance(values.get(k), int) for k in _LATENT):
        return {}
    nope, rope = (0 if defaults[k] == 0 else values[k] for k in _LATENT)
    return {k: nope + rope for k in ("head_dim", "qk_head_dim") if isinstance(defaults.get(k), int)
            and defaults[k] == sum(defaults[j] for j in _LATENT) and isinstance(values.get(k), int)}


CODES = 4  # codes in a tiny image (or audio) tokenizer's codebook
# The names a tokenizer gives the image codes in a vocabulary map the processor fills (left None in the config): the
# tokenizer's own strings, so per type. Extra names: Emu3's end of an image row.
_CODE_NAMES = {
    "chameleon": lambda i: "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z",
    "emu3": lambda i: f"<|visual token{i:06d}|>",
}
_MAP_EXTRAS = {"emu3": ("<|extra_200|>",)}


def _discrete_codes(model_type: str, values: dict, defaults: dict) -> dict:
    """A tokenizer whose image codes are vocabulary ids (Chameleon, Emu3: through a vocabulary map; Apertus 1.5:
    at a fixed offset, its audio codes after them): codebooks of ``CODES`` codes, their ids at the bottom of the
    reserved top of the tiny vocabulary (never text), the map's image placeholder and extras on free ids above."""
    offsets = sorted((v, k) for k, v in values.items() if str(k).endswith("_token_offset") and isinstance(v, int))
    mapped = "vocabulary_map" in values and values["vocabulary_map"] is None and model_type in _CODE_NAMES
    if not offsets and not mapped:
        return {}
    out = {}
    for key, sub in values.items():
        if _is_sub(key, sub):
            codes = {k: CODES for k in ("codebook_size", "num_embeddings") if isinstance(sub.get(k), int)}
            mult = sub.get("channel_multiplier")
            if isinstance(sub.get("base_channels"), int) and isinstance(mult, (list, tuple)) and mult:
                codes["base_channels"] = 32  # the tokenizer's convolutions narrow too (groups of 32 channels)
                d = defaults.get(key) or {}
                if d.get("hidden_size") == d.get("base_channels", 0) * mult[-1]:  # its attention over the last stage
                    codes["hidden_size"] = 32 * mult[-1]
            if codes:
                out[key] = {**sub, **codes}
    for n, (_, key) in enumerate(offsets):
        out[key] = VOCAB - 16 + CODES * n
    if mapped:
        taken = {v for k, v in values.items() if _TOKEN_ID.search(str(k)) and isinstance(v, int)}
        free = (i for i in range(VOCAB - 1, VOCAB - 16 + CODES, -1) if i not in taken)
        names = ("<image>", *_MAP_EXTRAS.get(model_type, ()))
        out["vocabulary_map"] = {**{_CODE_NAMES[model_type](i): VOCAB - 16 + i for i in range(CODES)},
                                 **{name: next(free) for name in names}}
        if "image_token_id" in values:  # the config's own, read from the map, not left None
            out["image_token_id"] = out["vocabulary_map"]["<image>"]
    return out


def _special_ids(values: dict, taken: list[int]) -> dict:
    """Token ids past the tiny vocabulary moved to its top, each to its own id."""
    out = {}
    for key, value in values.items():
        if _is_sub(key, value):
            out[key] = {**value, **_special_ids(value, taken)}
        elif isinstance(key, str) and _TOKEN_ID.search(key) and isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[key] = VOCAB - 1 - len(taken)
            taken.append(value)
    return out


def _int_layer_keys(values: dict) -> dict:
    """Per-layer tables keyed by layer index as strings ('05', as a nested config serialises them) keyed by int,
    in every sub-config, so that the causal-LM sweep maps them into the tiny depth."""
    out = {}
    for key, value in values.items():
        if key == "per_layer_config" and isinstance(value, dict) and all(str(k).isdigit() for k in value):
            out[key] = {int(k): v for k, v in value.items()}
        elif _is_sub(key, value):
            out[key] = _int_layer_keys(value)
        else:
            out[key] = value
    return out


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        # Sub-configs merge field by field; any other dict (a per-layer table) is replaced whole.
        sub = isinstance(v, dict) and isinstance(out.get(k), dict) and k != "per_layer_config" and (
            "model_type" in v or str(k).endswith("_config"))
        out[k] = _merge(out[k], v) if sub else v
    return out


def _kv_as_heads(values: dict) -> dict:
    """As many k/v heads as heads, in every (sub-)config."""
    out = {k: _kv_as_heads(v) if _is_sub(k, v) else v for k, v in values.items()}
    if isinstance(out.get("per_layer_config"), dict):  # a per-layer entry's own heads (Dots 3's sliding layers)
        out["per_layer_config"] = {i: _kv_as_heads(e) if isinstance(e, dict) else e
                                   for i, e in out["per_layer_config"].items()}
    if isinstance(out.get("num_key_value_heads"), int) and isinstance(out.get("num_attention_heads"), int):
        out["num_key_value_heads"] = out["num_attention_heads"]
    return out


def tiny_config(model_type: str, kv_as_heads: bool = False):
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    defaults = _int_layer_keys(base.to_dict())
    for key, cls in (getattr(type(base), "sub_configs", None) or {}).items():
        # A vision tower the config leaves out by default (Gemma 4's): its sub-config's own defaults.
        if "vision" in key and defaults.get(key) is None and getattr(cls, "model_type", "") and cls.__name__ != "AutoConfig":
            defaults[key] = _int_layer_keys(cls().to_dict())
    values = _merge(defaults, arch_sweep._tiny(defaults))
    values = _merge(values, _images(values))
    values = _merge(values, _stages(values, defaults))
    values = _merge(values, _merged_widths(values, defaults))
    values = _merge(values, _tied(values, defaults))
    values = _merge(values, _discrete_codes(model_type, values, defaults))
    values = _merge(values, _FILLED.get(model_type, {}))
    values = _merge(values, _special_ids(values, []))
    values = _merge(values, _sections(values))
    values = _kv_as_heads(values) if kv_as_heads else values
    values.pop("model_type", None)
    values.pop("transformers_version", None)
    cfg = AutoConfig.for_model(model_type, **values)
    for sub in (cfg, getattr(cfg, "text_config", None)):
        rope = getattr(sub, "rope_parameters", None)
        # Multimodal rotary sections the model defaults when the config names none (sized for head_dim 128).
        merges = isinstance(getattr(_vision(cfg), "spatial_merge_size", None), int)  # Qwen-VL-style (PaddleOCR-VL)
        mrope = "mrope_section" in getattr(type(sub), "ignore_keys_at_rope_validation", ()) or (merges and sub is not cfg)
        types = getattr(sub, "layer_types", None)
        entries = [rope] if isinstance(rope, dict) else []
        if rope == {} and isinstance(types, list) and types:
            # no rotary parameters, left to checkpoints, where the rotary embedding reads one set per layer type
            # (Cohere Compass): a default rotary for each type
            rope.update({kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in dict.fromkeys(types)})
            entries = list(rope.values())
        for entry in entries if mrope else ():
            default = {"mrope_section": [22, 22, 20], "partial_rotary_factor": entry.get("partial_rotary_factor", 1.0)}
            entry.setdefault("mrope_section", _sections(default)["mrope_section"])
        fields = sub.to_dict() if sub is not None else {}
        if "sliding_window" in fields and fields["sliding_window"] is None and any(
                "sliding" in k and not k.startswith("use_") for k in fields if k != "sliding_window"):
            sub.sliding_window = 16  # sliding-attention fields but no window: checkpoints set one (Step 3.7's)
        if "mlp_layer_types" in fields and fields["mlp_layer_types"] is None and fields.get("num_hidden_layers") == 2:
            sub.mlp_layer_types = ["dense", "sparse"]  # left None, read per layer (DeepSeek-OCR 2): one of each kind
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(sub, name, None), int) and getattr(sub, name) >= VOCAB:
                setattr(sub, name, 0)
    _placeholders(cfg, values)
    if getattr(cfg, "alpha_initializer", None) == "zeros":  # gated cross-attention (IDEFICS) open, so the image counts
        cfg.alpha_initializer = "ones"
    return cfg


def _placeholders(cfg, values: dict) -> None:
    """An image token id the config declares but leaves None (its processor adds the token: BLIP-2) set to a
    free id at the top of the tiny vocabulary; an encoder-decoder's missing decoder start and pad tokens (UDOP, VisionEncoderDecoder) 0."""
    taken = set()
    stack = [values]
    while stack:
        for key, value in stack.pop().items():
            if _is_sub(key, value):
                stack.append(value)
            elif _TOKEN_ID.search(str(key)) and isinstance(value, int) and not isinstance(value, bool):
                taken.add(value)
    free = (i for i in range(VOCAB - 2, VOCAB - 16, -1) if i not in taken)
    for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index"):  # a video model's
        if hasattr(cfg, name) and getattr(cfg, name) is None:
            setattr(cfg, name, next(free))
            break
    if getattr(cfg, "is_encoder_decoder", False):  # labels shifted right into decoder inputs need both
        for name in ("decoder_start_token_id", "pad_token_id"):
            if getattr(cfg, name, None) is None:
                setattr(cfg, name, 0)


def _vision(cfg):
    """The vision config: named as such, or an encoder's (VisionEncoderDecoder), or one inside that (T5Gemma 2, or a
    vision-language model's inside a robot policy: PI0's vlm_config)."""
    names = ("vision_config", "visual_config", "vision_tower_config", "encoder", "vlm_config")
    sub = next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), cfg)
    inner = next((getattr(sub, n) for n in names[:3] if getattr(sub, n, None) is not None), None) if sub is not cfg else None
    return inner if inner is not None else sub


def _first_int(cfg, names, default):
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, (list, tuple)) and v:
            v = v[0]
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default
