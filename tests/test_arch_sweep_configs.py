"""The architecture sweep's tiny configs (tests/arch_sweep.py): the generic rules that keep fields which a config
ties together in agreement when its sizes shrink. Configs only, no model is built: quick."""
from __future__ import annotations

import arch_sweep
from arch_sweep import _tiny, tiny_config


def test_mla_keeps_a_key_value_head_per_query_head():
    # the latent is expanded into every query head: fewer k/v heads would repeat them past the query heads
    cfg = tiny_config("deepseek_v32")
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 4
    # where the defaults group the heads (no MLA), the generic 2 k/v heads stay
    assert tiny_config("llama").num_key_value_heads == 2


def test_kv_shared_layers_keep_a_producer_of_every_kind():
    cfg = tiny_config("gemma3n_text")
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert cfg.num_hidden_layers == 4 and cfg.num_kv_shared_layers == 2
    assert cfg.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    assert cfg.intermediate_size == [128] * 4  # a size given layer by layer: tiny on every layer


def test_kv_sharing_defaults_of_zero_are_left_alone():
    cfg = tiny_config("gemma4_text")
    assert cfg.num_kv_shared_layers == 0 and cfg.num_hidden_layers == len(cfg.layer_types)


def test_per_layer_config_with_digit_keys_is_mapped_and_sized():
    values = {"num_hidden_layers": 6, "layer_types": ["full", "sliding", "sliding"] * 2,
              "per_layer_config": {"01": {"num_attention_heads": 64, "qk_nope_head_dim": 192}}}
    out = _tiny(values)
    assert out["layer_types"] == ["full", "sliding"]
    assert out["per_layer_config"] == {1: {"num_attention_heads": 4, "qk_nope_head_dim": 8}}


def test_extra_entries_merge_into_a_tiny_sub_config():
    cfg = tiny_config("dbrx")
    assert cfg.attn_config.rope_theta == 10000.0 and cfg.attn_config.clip_qkv == 8.0
    assert cfg.ffn_config.ffn_hidden_size == arch_sweep._SIZE["ffn_hidden_size"]  # the tiny fields stay
