"""``torchfuser bench``: train the user's own model with each variant (eager, torchfuser, torch.compile, ...)
on the same batches, one step of each in turn, and compare step time, tokens/s, memory and losses."""
from __future__ import annotations

import copy
import datetime
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from torchfuser import cuda_graphs, demo
from torchfuser.api import optimize, report
from torchfuser.bench_saved import SavedPerLayer
from torchfuser.cli import CLIError, _said
from torchfuser.report import console as _console

VARIANTS = ("eager", "torchfuser", "torchfuser-autotune", "compile", "torchfuser+compile", "torchfuser+graphs",
            "torchfuser+fp8", "torchfuser+fp8+graphs", "torchfuser-offload")
# torch.compile on a 2-core CPU takes minutes per variant: only where a GPU is there by default.
DEFAULT_VARIANTS = {"cpu": ("eager", "torchfuser"), "cuda": ("eager", "torchfuser", "compile", "torchfuser+compile")}
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _fail(msg: str):
    """A mistake in what the user asked for: ``torchfuser bench`` prints it as one line and exits 2."""
    raise CLIError(msg)


def small_config(model_type: str, device: str):
    """The model type's transformers config at the demo's sizes (a few layers, hidden 256 on the CPU):
    passed to the config's constructor, so fields derived from them (layer_types, head_dim) follow."""
    from transformers import AutoConfig

    s = demo.SIZES[device]
    try:
        default = AutoConfig.for_model(model_type)
    except ValueError:
        _fail(f"{model_type!r} is neither a config.json, a checkpoint directory nor a transformers model type (e.g. llama, qwen2, gpt2)")
    vocab = default.vocab_size if getattr(default, "vocab_size", 0) and default.vocab_size <= 65536 else s.vocab
    return AutoConfig.for_model(model_type, hidden_size=s.hidden, intermediate_size=s.intermediate,
                                num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                                head_dim=s.hidden // s.heads, vocab_size=vocab, max_position_embeddings=max(s.seq, 2048))


def load_model(target: str, device: str, seed: int):
    """(model on the CPU, a description): random weights from a model type's small config or a
    config.json, or a checkpoint directory's own weights when it holds them (read locally, never downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            _fail(f"{target} is a directory without a config.json")
        if any((path / w).is_file() for w in _WEIGHTS):
            try:
                model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, attn_implementation="sdpa",
                                                             dtype=torch.float32)
            except Exception as err:  # transformers raises many error types for a bad checkpoint
                _fail(f"cannot load the checkpoint in {target}: {_said(err)}")
            return model, f"{target} (its weights)"
        cfg, what = AutoConfig.from_pretrained(path, local_files_only=True), f"{target} (random weights)"
    elif path.suffix == ".json" or path.is_file():
        if not path.is_file():
            _fail(f"no such config file {target!r}")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            _fail(f"{target} is not valid JSON ({err})")
        if not isinstance(data, dict) or "model_type" not in data:
            _fail(f"{target} has no 'model_type' field; it must be a transformers config.json")
        try:
            cfg = AutoConfig.for_model(data.pop("model_type"), **data)
        except Exception as err:  # transformers' validators raise their own error types
            _fail(f"{target} is not a valid transformers config: {_said(err)}")
        what = f"{target} (random weights)"
    else:
        cfg, what = small_config(target, device), f"{target} (small default config, random weights)"
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(cfg), what
    except Exception as err:
        _fail(f"transformers cannot build a causal LM from this config: {_said(err)}")


def _add_lora(model, r: int, seed: int):
    import peft

    torch.manual_seed(seed + 2)  # the same adapters in every variant
    # "all-linear": every projection of the attention and MLP blocks (the output layer excluded).
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def build_variant(name: str, base, lora: int | None, seed: int):
    """The model one variant trains: a copy of ``base``, fused before LoRA is added (adapters added
    after optimize keep the blocks fused), compiled last."""
    from torchfuser import autotune

    model = copy.deepcopy(base)
    if name.startswith("torchfuser"):
        optimize(model, cuda_graphs=True if name.endswith("+graphs") else "auto", fp8="rowwise" if "+fp8" in name else None,
                 checkpointing="offload" if name == "torchfuser-offload" else False)
    if lora:
        model = _add_lora(model, lora, seed)
    if name == "torchfuser-autotune":
        autotune.apply(model)
    if name.endswith("compile"):
        model = torch.compile(model)
    return model


def _resident_bytes(model, opt) -> int:
    """Parameters, gradients and optimizer state of one variant (each storage once)."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class _Variant:
    def __init__(self, name, model, device, progress, steps):
        self.name, self.model, self.device, self.progress = name, model, device, progress
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=demo.LR)
        # saved: the bytes autograd saved for the backward (largest step); peak: CUDA only, see step().
        self.losses, self.times, self.saved, self.peak = [], [], 0, None
        # per layer: counted in the first step only (hooks on the layers; compiled and graphed variants: never)
        self.per_layer = None if "compile" in name or name.endswith("+graphs") else []
        self.task = progress.add_task(f"{name:<20}", total=steps)

    def step(self, ids):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            # As the step starts: a capture inside this step is counted by the allocated peak itself.
            graphs = cuda_graphs.pool_bytes(self.model)[0]
        start = time.perf_counter()
        counted = SavedPerLayer(self.model, per_layer=self.per_layer == [])
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda), counted as saved:
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        if self.per_layer == [] and saved.layers:
            self.per_layer = saved.layers
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(self.device)
            # All variants live on the device at once: this one's peak is its own resident state plus
            # what its step allocated above the step's start, as if it ran alone, plus its CUDA graphs' pool
            # (allocated before the step or read as unallocated; replays allocate nothing).
            peak = torch.cuda.max_memory_allocated(self.device) - before + _resident_bytes(self.model, self.opt) + graphs
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        self.saved = max(self.saved, saved.total)
        if cuda:
            self.peak = max(self.peak or 0, peak)
        self.progress.update(self.task, advance=1, description=f"{self.name:<20} loss {self.losses[-1]:.3f}")


def _warmup(steps: int) -> int:
    """Steps left out of the median: compilation and allocator growth happen there."""
    return 0 if steps == 1 else 1 if steps < 8 else 3


def _versions(device) -> dict:
    import transformers

    import torchfuser

    return {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": transformers.__version__, "torchfuser": torchfuser.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def check_variants(names, device) -> tuple[str, ...]:
    for n in names:
        if n not in VARIANTS:
            _fail(f"unknown variant {n!r}; choose from {', '.join(VARIANTS)}")
    for n in names:
        if n.endswith("+graphs") and device.type != "cuda":
            _fail(f"the variant {n} needs --device cuda (CUDA graphs)")
        if "+fp8" in n and device.type != "cuda":
            _fail(f"the variant {n} needs --device cuda: a GPU with FP8 GEMMs (compute capability 8.9 or newer); "
                  "the CPU steps run without bf16 autocast, so FP8 would not run")
    return tuple(dict.fromkeys(names))


def resolve_device(device: str | None) -> torch.device:
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        _fail(f"unknown device {device!r}; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        _fail(f"--device {device} but CUDA is not available (torch {torch.__version__} sees no GPU)")
    if dev.type not in ("cpu", "cuda"):
        _fail(f"--device {device}: only cpu and cuda are measured")
    return dev


def run(target: str, device=None, steps: int = 10, batch=None, seq=None, variants=None, lora=None,
        json_path=None, plot_path=None, seed: int = 0, console: Console | None = None) -> list[dict]:
    """Train ``target`` with each variant, one step of each in turn on the same batches (so load
    that comes and goes hits them alike), print a table; returns one row per variant. The caller's
    random generators are left as they were."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        return _run(target, device, steps, batch, seq, variants, lora, json_path, plot_path, seed, console)


def _run(target, device, steps, batch, seq, variants, lora, json_path, plot_path, seed, console) -> list[dict]:
    console = console or _console()
    dev = resolve_device(device)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    names = check_variants(variants or DEFAULT_VARIANTS[kind], dev)
    if plot_path:
        from torchfuser.bench_plot import check_matplotlib

        check_matplotlib()  # before the run, not after it
    base, what = load_model(target, kind, seed)
    base.to(dev).train()
    size = SimpleNamespace(vocab=base.config.vocab_size, batch=batch or demo.SIZES[kind].batch, seq=seq or demo.SIZES[kind].seq)
    models = {n: build_variant(n, base, lora, seed) for n in names}
    del base
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    console.print(f"[bold]torchfuser bench[/] {what} on {dev}: {params / 1e6:.1f}M parameters, batch {size.batch}×{size.seq} "
                  f"tokens, {steps} steps{f', LoRA r={lora}' if lora else ''}; variants {', '.join(names)}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        runs = [_Variant(n, m, dev, progress, steps) for n, m in models.items()]
        order = list(runs)
        # Every variant's step i draws the same dropout masks (the same generator state), so the loss
        # parity below compares like with like; the caller's generators are left as they were.
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            for i, ids in enumerate(demo.batches(size, steps, dev, seed)):
                for r in order:
                    torch.manual_seed(seed + 1000 + i)
                    r.step(ids)
                order.reverse()
    rows = _rows(runs, size, steps, lora, target, dev)
    print_table(console, rows)
    if json_path:
        Path(json_path).write_text("".join(json.dumps(r) + "\n" for r in rows))
        console.print(f"wrote {len(rows)} rows to {json_path}")
    if plot_path:
        from torchfuser.bench_plot import plot

        plot(rows, plot_path)
        console.print(f"wrote {plot_path}")
    return rows


def _rows(runs, size, steps, lora, target, dev) -> list[dict]:
    ref = next((r for r in runs if r.name == "eager"), runs[0])
    tokens, skip, common = size.batch * size.seq, _warmup(steps), _versions(dev)
    rows = []
    for r in runs:
        step_s = statistics.median(r.times[skip:])
        rep = report(r.model)
        rows.append({
            "variant": r.name, "ms_per_step": step_s * 1e3, "tokens_per_s": tokens / step_s,
            "ms_per_step_min": min(r.times[skip:]) * 1e3,
            # Paired per step: the variants ran back to back, so a step's ratio cancels the load of that moment.
            "speedup_vs_reference": statistics.median(a / b for a, b in zip(ref.times[skip:], r.times[skip:])),
            # CUDA graph replays restore their saved tensors without the hooks: nothing to count there.
            "saved_activation_bytes": None if r.name.endswith("+graphs") else r.saved,
            # the first step's, per decoder layer (None: not counted, see _Variant); the table shows the largest
            "saved_activation_bytes_per_layer": r.per_layer or None,
            "peak_memory_bytes": r.peak,  # measured on CUDA only; None on the CPU
            "peak_memory_measure": "cuda_max_memory_allocated_as_alone_with_graph_pools" if r.peak is not None else None,
            "losses": r.losses, "loss_reference": ref.name,
            "loss_max_rel_diff": max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref.losses, r.losses)),
            "step_ms": [t * 1e3 for t in r.times], "warmup_steps": skip,
            "fusion": rep.summary() if r.name.startswith("torchfuser") else None,
            "notes": [n for n in rep.notes if n.startswith("autotune")] if r.name.startswith("torchfuser") else [],
            "model": target, "batch": size.batch, "seq": size.seq, "steps": steps, "lora": lora, **common,
        })
    return rows


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def _size(n) -> str:
    """MiB, or KiB below one MiB (a tiny model's layer)."""
    return _mib(n) if n is None or n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def print_table(console: Console, rows: list[dict]) -> None:
    ref = rows[0]
    peak = any(r["peak_memory_bytes"] is not None for r in rows)
    table = Table(title=f"median of steps after the first {ref['warmup_steps']}", title_justify="left")
    columns = ("variant", "ms/step", "speed-up", "tokens/s", *(("peak memory",) if peak else ()), "saved act.",
               "saved/layer", "loss Δ")
    for col in columns:
        table.add_column(col, justify="left" if col == "variant" else "right",
                         min_width=max(len(r["variant"]) for r in rows) if col == "variant" else None)
    for r in rows:
        table.add_row(r["variant"], f"{r['ms_per_step']:.1f}", f"{r['speedup_vs_reference']:.2f}×",
                      f"{r['tokens_per_s']:,.0f}", *((_mib(r["peak_memory_bytes"]),) if peak else ()),
                      _mib(r["saved_activation_bytes"]), _size(max(r.get("saved_activation_bytes_per_layer") or [None])),
                      f"{r['loss_max_rel_diff']:.1e}")
    console.print(table)
    console.print(f"speed-up: the median over steps of {ref['loss_reference']}'s step time / the variant's in the same round; "
                  f"loss Δ: the largest relative difference of a step's loss from {ref['loss_reference']}'s")
    for r in rows:
        if r["fusion"]:
            console.print(f"{r['variant']}: {r['fusion']}")
        for note in r["notes"]:
            console.print(f"{r['variant']}: {note}")
    if peak:
        console.print("peak memory: the variant's largest CUDA allocation in a step as if it were alone on the device "
                      "(its parameters, gradients and optimizer state, plus what the step allocated, plus the memory its "
                      "CUDA graphs hold)")
    console.print("saved act.: bytes autograd saved for the backward in a step (activations, each storage once; "
                  "under torch.compile what the compiled graph saves; n/a under CUDA graphs; with checkpointing, the "
                  "layer inputs kept on the host too); saved/layer: the part saved while one decoder layer ran, the "
                  "largest layer, first step (n/a under torch.compile and CUDA graphs)")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a transformers model type (llama, qwen2, gpt2, ...), a config.json or a checkpoint directory")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 4 on the CPU, 8 on a GPU)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 128 on the CPU, 1024 on a GPU)")
    parser.add_argument("--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)} "
                        "(default: eager,torchfuser on the CPU; and compile, torchfuser+compile on a GPU)")
    parser.add_argument("--lora", type=int, default=None, metavar="R", help="train PEFT LoRA adapters of rank R instead")
    parser.add_argument("--json", default=None, metavar="PATH", help="write one JSON line per variant")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of step time, memory and losses")
    parser.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    for flag in ("steps", "batch", "seq", "lora"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            _fail(f"--{flag} must be at least 1")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else None
    run(args.model, device=args.device, steps=args.steps, batch=args.batch, seq=args.seq, variants=variants,
        lora=args.lora, json_path=args.json, plot_path=args.plot, seed=args.seed)
    return 0
