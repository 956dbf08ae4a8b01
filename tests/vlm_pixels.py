"""Pixel inputs for tests/vlm_sweep.py: the shapes and side inputs image-text models take, as their processors
make them (flattened patches with a grid, NaFlex patches with their shapes, patches with (x, y) positions, tiles
with aspect ratios, one image a row, several images a row)."""
from __future__ import annotations

import inspect

import torch

from vlm_configs import PATCHES, VOCAB, _first_int, _vision


def text_only(model) -> bool:
    """Whether the model is a causal LM alone: a config with no sub-config (no tower of another kind: Evolla's
    protein encoder) and a forward that takes no image; the image-text mapping lists one for the text half of a
    checkpoint whose vision tower is another type's (Mistral 4 for Mistral Small 4, which loads as Mistral 3)."""
    from transformers import PretrainedConfig

    cfg = model.config
    params = inspect.signature(type(model).forward).parameters
    return not getattr(type(cfg), "sub_configs", None) and not any(
        isinstance(v, PretrainedConfig) for v in vars(cfg).values()) and not any("pixel" in p for p in params)


def pixel_candidates(model, n_images: int):
    """Pixel inputs of the shapes image-text models take, most specific first (keyword → tensor); none at all for a
    text-only model."""
    if text_only(model):
        yield {}
        return
    vis = _vision(model.config)
    params = inspect.signature(type(model).forward).parameters
    gen = torch.Generator().manual_seed(2)
    channels = _first_int(vis, ("num_channels", "in_channels", "in_chans", "image_channels"), 3)
    patch = _first_int(vis, ("patch_size",), 14)
    size = _first_int(vis, ("image_size",), patch * PATCHES)
    if "image_grid_thw" in params:
        temporal = _first_int(vis, ("temporal_patch_size", "patch_temporal"), 1)
        merge = _first_int(vis, ("spatial_merge_size", "merge_size", "merge_kernel_size"), 1)
        side = 2 * merge
        grid = {"pixel_values": torch.randn(n_images * side * side, channels * temporal * patch * patch, generator=gen),
                "image_grid_thw": torch.tensor([[1, side, side]] * n_images)}
        if "image_merge_sizes" in params:  # VideoLLaMA 3: the merge size per image
            grid["image_merge_sizes"] = torch.tensor([merge] * n_images)
        yield grid
        if temporal == 1:  # each patch as a C × p × p image (Kimi-K2.5, PaddleOCR-VL)
            yield {**grid, "pixel_values": grid["pixel_values"].view(-1, channels, patch, patch)}
        if merge > 1:  # one image token's merge × merge patches as a channels-last image, the grid in tokens (Inkling 2)
            pm = patch * merge
            yield {**grid, "pixel_values": torch.randn(n_images * side * side, pm, pm, channels, generator=gen)}
    if "image_grid_hw" in params:  # flattened patches with an (h, w) grid (Nemotron-H Omni)
        merge = _first_int(vis, ("spatial_merge_size", "merge_size", "merge_kernel_size"), 1)
        side = 2 * merge
        yield {"pixel_values": torch.randn(n_images * side * side, channels * patch * patch, generator=gen),
               "image_grid_hw": torch.tensor([[side, side]] * n_images)}
    if "image_token_pooling" in params and "image_grids" in params:  # Molmo 2: one crop an image, 2 × 2 patches pooled
        side = PATCHES // 2  # into each image token; each image's pooling indexes its own patches
        r, c, dr, dc = torch.meshgrid(*(torch.arange(n) for n in (side, side, 2, 2)), indexing="ij")
        pool = ((r * 2 + dr) * PATCHES + c * 2 + dc).reshape(side * side, 4)
        yield {"pixel_values": torch.randn(n_images, PATCHES**2, channels * patch * patch, generator=gen),
               "image_token_pooling": pool.repeat(n_images, 1), "image_grids": torch.tensor([[side, side, 0, 0]] * n_images),
               "image_num_crops": torch.ones(n_images, dtype=torch.long)}
    if "spatial_shapes" in params and "pixel_attention_mask" in params:  # NaFlex patches (LFM2-VL's SigLIP 2)
        yield {"pixel_values": torch.randn(n_images, PATCHES**2, channels * patch * patch, generator=gen),
               "spatial_shapes": torch.tensor([[PATCHES, PATCHES]] * n_images),
               "pixel_attention_mask": torch.ones(n_images, PATCHES**2, dtype=torch.long)}
    if "image_patches" in params:  # Fuyu: the image's patches, flattened, straight into its projection
        patches = torch.randn(n_images, PATCHES**2, channels * patch * patch, generator=gen)
        yield {"image_patches": patches}
        yield {"pixel_values": patches}  # the name its get_image_features takes them by
    if "target_sizes" in params:  # MiniCPM-V: every image's patches in one row of p-high strips, its (h, w) in patches
        yield {"pixel_values": torch.randn(1, channels, patch, n_images * PATCHES**2 * patch, generator=gen),
               "target_sizes": torch.tensor([[PATCHES, PATCHES]] * n_images)}
    if "aspect_ratio_ids" in params:  # tiles (Mllama): one image a row in its first tile, the others padding
        tiles = _first_int(vis, ("max_num_tiles",), 1)
        mask = torch.zeros(n_images, 1, tiles, dtype=torch.long)
        mask[..., 0] = 1
        yield {"pixel_values": torch.randn(n_images, 1, tiles, channels, size, size, generator=gen),
               "aspect_ratio_ids": torch.ones(n_images, 1, dtype=torch.long), "aspect_ratio_mask": mask}
    positions = next((n for n in ("image_position_ids", "pixel_position_ids") if n in params), None)
    if positions is not None:  # patches flattened a row, with their (x, y) on the grid (Gemma 4's processor)
        side = 2 * _first_int(vis, ("pooling_kernel_size",), PATCHES // 2)  # pooled by k × k patches
        xy = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(-1, 2)
        for p in dict.fromkeys((patch, _first_int(vis, ("model_patch_size",), patch))):  # Gemma 4 unified: its own
            yield {"pixel_values": torch.rand(n_images, side * side, channels * p * p, generator=gen),
                   positions: xy.expand(n_images, -1, -1).clone()}
    if "flattened_patches" in params:  # Pix2Struct-style: each patch's (row, column), then its pixels
        dim = _first_int(vis, ("patch_embed_hidden_size",), channels * patch * patch)
        rows, cols = torch.meshgrid(torch.arange(1, PATCHES + 1), torch.arange(1, PATCHES + 1), indexing="ij")
        pos = torch.stack([rows, cols], -1).reshape(1, -1, 2).expand(n_images, -1, -1).float()
        flat = torch.cat([pos, torch.randn(n_images, PATCHES**2, dim, generator=gen)], -1)
        side = {k: torch.tensor([patch * PATCHES] * n_images) for k in ("width", "height") if k in params}
        yield {"flattened_patches": flat, **side}
    extra = {"image_sizes": torch.tensor([[size, size]] * n_images)} if "image_sizes" in params else {}
    high = getattr(model.config, "high_res_vision_config", None)
    if "high_res_pixel_values" in params and high is not None:  # DeepSeek-VL hybrid: the image at its high resolution
        hs = _first_int(high, ("image_size",), size)
        extra["high_res_pixel_values"] = torch.randn(n_images, channels, hs, hs, generator=gen)
    if "qformer_input_ids" in params:  # InstructBLIP: the instruction, given to its Q-Former too
        extra["qformer_input_ids"] = torch.randint(3, VOCAB - 16, (n_images, 4), generator=gen)
    for shape in ((n_images, channels, size, size), (n_images, 1, channels, size, size), (n_images, 2, channels, size, size)):
        pixels = torch.randn(*shape, generator=gen)
        if not {"qformer_input_ids", "high_res_pixel_values"} & set(extra):  # both required
            yield {"pixel_values": pixels}
        if extra:
            yield {"pixel_values": pixels, **extra}
        if "pixel_attention_mask" in params and len(shape) == 5:  # every pixel, or every tile, real (Granite-Docling)
            for mask in (torch.ones(*shape[:2], size, size, dtype=torch.bool), torch.ones(*shape[:2], dtype=torch.bool)):
                yield {"pixel_values": pixels, **extra, "pixel_attention_mask": mask}
