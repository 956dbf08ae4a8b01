"""``torchfuser bench``: inputs it accepts and refuses, the rows it writes, losses in parity.
Tiny models, two steps; timings are produced, never checked."""
from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

from torchfuser import bench, demo, report
from torchfuser.cli import main

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128)


@pytest.fixture
def config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def _bench(target, *extra):
    return ["bench", str(target), "--device", "cpu", "--steps", "2", "--batch", "2", "--seq", "8", *extra]


@pytest.mark.parametrize("argv, message", [
    (["bench", "no_such_type", "--device", "cpu"], "neither a config.json"),
    (["bench", "llama", "--device", "cpu", "--variants", "eager,fast"], "unknown variant 'fast'"),
    (["bench", "llama", "--device", "cpu", "--variants", "torchfuser+graphs"], "needs --device cuda"),
    (["bench", "llama", "--device", "cpu", "--variants", "eager,torchfuser+fp8"], "torchfuser+fp8 needs --device cuda"),
    (["bench", "llama", "--device", "tpu9"], "device"),
    (["bench", "missing.json", "--device", "cpu"], "no such config file"),
    (["bench", "llama", "--device", "cpu", "--steps", "0"], "--steps must be at least 1"),
])
def test_bad_input_one_line(argv, message, capsys):
    """A mistake is one line on stderr and exit 2, as in the other subcommands and argparse."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchfuser bench: ") and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda(capsys):
    assert main(["bench", "llama", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_rows_json_plot(config_json, tmp_path, capsys):
    out, png = tmp_path / "rows.jsonl", tmp_path / "bench.png"
    assert main(_bench(config_json, "--variants", "eager,torchfuser,torchfuser-autotune", "--json", str(out), "--plot", str(png))) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["variant"] for r in rows] == ["eager", "torchfuser", "torchfuser-autotune"]
    for r in rows:
        assert len(r["losses"]) == 2 and r["ms_per_step"] >= r["ms_per_step_min"] > 0 and r["tokens_per_s"] > 0
        assert r["speedup_vs_reference"] > 0
        # On the CPU only the saved activations are measured: no peak is given under that name.
        assert r["saved_activation_bytes"] > 0 and r["peak_memory_bytes"] is None and r["peak_memory_measure"] is None
        assert r["loss_max_rel_diff"] < 1e-4  # every variant trains the same model on the same batches
        assert {"device", "torch", "transformers", "date", "batch", "seq"} <= set(r)
    assert rows[0]["speedup_vs_reference"] == 1.0 and rows[0]["fusion"] is None and "blocks fused" in rows[1]["fusion"]
    assert any(n.startswith("autotune: ") for n in rows[2]["notes"])
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "tokens/s" in capsys.readouterr().out


def test_checkpoint_dir_weights_are_loaded(tmp_path):
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    torch.manual_seed(5)
    saved = LlamaForCausalLM(cfg)
    saved.save_pretrained(tmp_path)
    model, what = bench.load_model(str(tmp_path), "cpu", seed=0)
    assert "its weights" in what
    torch.testing.assert_close(model.lm_head.weight, saved.lm_head.weight, rtol=0, atol=0)
    (tmp_path / "model.safetensors").unlink()  # a directory with a config alone: random weights
    model, what = bench.load_model(str(tmp_path), "cpu", seed=0)
    assert "random weights" in what and not torch.equal(model.lm_head.weight, saved.lm_head.weight)


def test_lora_every_variant(config_json):
    rows = bench.run(str(config_json), device="cpu", steps=2, batch=2, seq=8, variants=["eager", "torchfuser"], lora=2,
                     console=Console(quiet=True))
    assert rows[1]["loss_max_rel_diff"] < 1e-4 and rows[1]["lora"] == 2
    base, _ = bench.load_model(str(config_json), "cpu", seed=0)
    fused = bench.build_variant("torchfuser", base, lora=2, seed=0)
    trainable = [n for n, p in fused.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert report(fused).counts()["attention"]["fused"] == 1  # adapters added after optimize keep the fusion


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_small_default_config(model_type):
    cfg = bench.small_config(model_type, "cpu")
    s = demo.SIZES["cpu"]
    assert cfg.hidden_size == s.hidden and cfg.num_hidden_layers == s.layers and cfg.vocab_size <= 65536


def test_dropout_masks_are_the_same_in_every_variant(tmp_path):
    """Variants run in alternation: each step of each variant starts from the same generator state,
    so a model with dropout gets the same masks fused and unfused, and the loss parity is exact; the
    caller's generator is left as it was."""
    path = tmp_path / "gpt2.json"
    path.write_text(json.dumps(dict(model_type="gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=128, n_positions=32,
                                    resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3, bos_token_id=0, eos_token_id=0)))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    rows = bench.run(str(path), device="cpu", steps=2, batch=2, seq=8, variants=["eager", "torchfuser"],
                     console=Console(quiet=True))
    assert torch.equal(torch.get_rng_state(), before)
    assert rows[1]["loss_max_rel_diff"] < 1e-5, rows[1]["losses"]


def _rows(losses, step_ms, warmup=1):
    common = dict(loss_reference="eager", warmup_steps=warmup, model="llama", device="cpu", batch=2, seq=8,
                  torch="2.x", transformers="5.x", peak_memory_bytes=None, saved_activation_bytes=2**20)
    return [dict(variant=name, losses=losses, step_ms=ms, ms_per_step=sorted(ms[warmup:])[len(ms[warmup:]) // 2], **common)
            for name, ms in step_ms.items()]


def test_plot_shows_both_loss_lines_integer_steps_and_every_step_time():
    """Read from the figure's artists, not its pixels: eager's loss line drawn last and dashed over the fused one
    (equal losses hide neither), step ticks at whole numbers, each step's time a point beside the median."""
    pytest.importorskip("matplotlib")
    from matplotlib.ticker import MaxNLocator

    from torchfuser.bench_plot import figure

    losses = [5.0, 4.8, 4.7, 4.65]  # the same in both variants: the case where one line hid the other
    rows = _rows(losses, {"eager": [12.0, 7.8, 9.1, 8.2], "torchfuser": [10.0, 6.0, 6.5, 6.2]})
    fig = figure(rows)
    ax_t, ax_m, ax_l = fig.axes[:3]
    lines = {line.get_label(): line for line in ax_l.get_lines()}
    eager, fused = lines["eager"], lines["torchfuser"]
    assert eager.get_zorder() > fused.get_zorder() and eager.get_linestyle() == "--" and fused.get_linestyle() == "-"
    assert eager.get_marker() != fused.get_marker() and list(eager.get_ydata()) == losses
    assert isinstance(ax_l.xaxis.get_major_locator(), MaxNLocator)
    fig.canvas.draw()
    ticks = [t for t in ax_l.get_xticks() if ax_l.get_xlim()[0] <= t <= ax_l.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    points = sorted(float(y) for c in ax_t.collections for _, y in c.get_offsets())
    assert points == sorted(rows[0]["step_ms"] + rows[1]["step_ms"])  # every step, warm-up included (hollow)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_table_on_cuda_gives_peak_and_saved_under_their_names():
    """Rows as a GPU run writes them (no GPU needed): the peak and the saved activations in their own columns,
    n/a where CUDA graph replays leave nothing to count."""
    rows = _rows([5.0, 4.9], {"eager": [3.0, 2.0], "torchfuser+graphs": [2.0, 1.0]})
    for r, peak, saved in zip(rows, (3 * 2**30, 2 * 2**30), (2**29, None)):
        r.update(peak_memory_bytes=peak, peak_memory_measure="cuda_max_memory_allocated_as_alone_with_graph_pools",
                 saved_activation_bytes=saved, speedup_vs_reference=1.0, tokens_per_s=1.0, loss_max_rel_diff=0.0,
                 fusion=None, notes=[])
    console = Console(record=True, width=160)
    bench.print_table(console, rows)
    text = console.export_text()
    assert "peak memory" in text and "saved act." in text
    assert "3,072.0 MiB" in text and "512.0 MiB" in text and "n/a" in text


def test_saved_bytes_per_layer_and_the_offload_variant(tmp_path, capsys):
    """Saved activations per decoder layer in the JSON and the table: the offloaded variant's layers keep
    only their input (batch × seq × hidden fp32), the fused ones far more; compiled variants are not counted."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(TINY, num_hidden_layers=2)))
    out = tmp_path / "rows.jsonl"
    assert main(_bench(path, "--variants", "eager,torchfuser,torchfuser-offload", "--json", str(out))) == 0
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    layer_input = 2 * 8 * TINY["hidden_size"] * 4
    assert rows["torchfuser-offload"]["saved_activation_bytes_per_layer"] == [layer_input] * 2
    for name in ("eager", "torchfuser"):
        assert all(b > 4 * layer_input for b in rows[name]["saved_activation_bytes_per_layer"]), rows[name]
    assert rows["torchfuser-offload"]["loss_max_rel_diff"] < 1e-5
    assert rows["torchfuser-offload"]["saved_activation_bytes"] < rows["torchfuser"]["saved_activation_bytes"]
    text = capsys.readouterr().out
    assert "saved/layer" in text and f"{layer_input / 2**10:,.1f} KiB" in text


class _FakeCudaMemory:
    """torch.cuda's memory counters as a GPU step would move them, for the CUDA branch of a step on the CPU: the
    step starts at 5 GiB allocated and peaks 2 GiB above it."""

    def __init__(self, monkeypatch):
        gib = 2**30
        for name, value in (("synchronize", None), ("reset_peak_memory_stats", None), ("memory_allocated", 5 * gib),
                            ("max_memory_allocated", 7 * gib)):
            monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)


class _Stack:  # what install() keeps on a model for each stack of graphed layers: only its pool is read here
    def pool_bytes(self):
        return 3 * 2**30, 2 * 2**30


@pytest.mark.parametrize("tool", ["bench", "demo"])
def test_a_cuda_steps_peak_counts_what_its_cuda_graphs_hold(tool, monkeypatch):
    """The peak a GPU step reports adds the graphs' pool, which replays never allocate: the bench (as if alone:
    the step's growth, the resident state, the whole pool) and the demo (the allocated peak, and the pool's part
    that reads as unallocated)."""
    from rich.progress import Progress

    from torchfuser import cuda_graphs

    _FakeCudaMemory(monkeypatch)
    autocast = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: autocast("cpu", enabled=False))  # the model runs on the CPU
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"}))
    model.__dict__[cuda_graphs._ATTR] = [_Stack()]
    ids = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    cuda = type("Device", (), {"type": "cuda"})()
    with Progress(disable=True) as progress:
        if tool == "bench":
            run = bench._Variant("torchfuser", model, cuda, progress, 1)
            run.step(ids)
            assert run.peak == 2 * 2**30 + bench._resident_bytes(model, run.opt) + 3 * 2**30
        else:
            run = demo._Run(model, cuda, progress, "fused", 1)
            run.step(ids)
            assert run.peak == 7 * 2**30 + 2 * 2**30
