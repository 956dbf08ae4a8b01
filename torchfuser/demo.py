"""``torchfuser demo``: train a small Llama-style model with and without TorchFuser, side by side."""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from torchfuser import cuda_graphs
from torchfuser.api import optimize, report
from torchfuser.modules import recompute
from torchfuser.report import console as _console


LR = 3e-4  # with clipping: bf16 runs of eager and fused stay within ~1e-3 of each other
GRAPHED = "torchfuser + cuda graphs"  # the third variant on a GPU


@dataclass(frozen=True)
class DemoSize:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


# Small enough for a 2-core CPU in under a minute, with a real vocabulary size (Llama-2's): the LM head
# and its loss are a large part of a small model's step. Larger where a GPU is there.
SIZES = {
    "cpu": DemoSize(hidden=256, intermediate=704, layers=4, heads=8, kv_heads=4, vocab=32000, batch=4, seq=128),
    "cuda": DemoSize(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000, batch=8, seq=1024),
}


def build_model(size: DemoSize, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=size.hidden, intermediate_size=size.intermediate, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=size.kv_heads, vocab_size=size.vocab,
        max_position_embeddings=size.seq, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def batches(size: DemoSize, steps: int, device, seed: int):
    """Tokens drawn from a fixed Zipf-like unigram distribution: learnable, but the loss levels off
    at the distribution's entropy instead of collapsing, so two correct runs stay together and their
    difference measures the numerics, not the chaos of a memorisation task."""
    gen = torch.Generator().manual_seed(seed + 1)
    probs = 1.0 / torch.arange(1, size.vocab + 1, dtype=torch.float64) ** 1.1
    for _ in range(steps):
        ids = torch.multinomial(probs, size.batch * size.seq, replacement=True, generator=gen)
        yield ids.view(size.batch, size.seq).to(device)


class _SavedBytes:
    """Bytes of activations autograd saves for the backward: a device-independent memory measure."""

    def __init__(self):
        self.total = 0
        self._seen = set()

    def __enter__(self):
        def pack(t):
            # Parameters are not activations; a tensor saved by several ops is held once.
            key = t.untyped_storage().data_ptr()
            if not isinstance(t, torch.nn.Parameter) and key not in self._seen:
                self._seen.add(key)
                self._count(t.untyped_storage().nbytes())
            return t

        setattr(pack, recompute.COUNTING, True)  # it only counts: what is made again is not counted
        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def _count(self, nbytes: int) -> None:
        self.total += nbytes


class _Run:
    """One model's training in the demo: its optimizer, losses, step times and saved bytes."""

    def __init__(self, model, device, progress, label, steps):
        self.model, self.device, self.progress, self.label = model, device, progress, label
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
        self.losses, self.times, self.saved, self.peak = [], [], 0, 0
        self.task = progress.add_task(label, total=steps)

    def step(self, ids):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            # CUDA graphs' pools keep reserved what reads as unallocated (replays allocate nothing): added back, as
            # the step starts (a capture inside this step is in the allocated peak itself).
            unallocated = cuda_graphs.pool_bytes(self.model)[1]
        start = time.perf_counter()
        with self.autocast, _SavedBytes() as counter:
            loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)  # as training recipes do; no spikes
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) + unallocated)
        self.times.append(time.perf_counter() - start)
        self.losses.append(loss.item())
        self.saved = max(self.saved, counter.total)
        self.progress.update(self.task, advance=1, description=f"{self.label} loss {self.losses[-1]:.3f}")

    def result(self) -> dict:
        warm = self.times[min(3, len(self.times) - 1):]
        return {"losses": self.losses, "step_s": statistics.median(warm), "saved_bytes": self.saved,
                "peak_bytes": self.peak if self.device.type == "cuda" else None}


def train(models: dict, size, steps, device, seed, progress) -> dict:
    """Train every model on the same batches, one step each in turn (the order alternating): on a
    shared CPU, load that comes and goes during the demo then moves all timings alike."""
    runs = {name: _Run(model, device, progress, f"{name:<10}", steps) for name, model in models.items()}
    order = list(runs.values())
    for ids in batches(size, steps, device, seed):
        for run in order:
            run.step(ids)
        order.reverse()
    return {name: run.result() for name, run in runs.items()}


def run(device: str | None = None, steps: int = 30, backend: str = "auto", seed: int = 0,
        console: Console | None = None) -> dict:
    """Train the demo model eagerly and with TorchFuser (on a GPU also with its decoder layers as
    CUDA graphs), print the report and a side-by-side table; returns each variant's numbers."""
    console = console or _console()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = SIZES["cuda" if dev.type == "cuda" else "cpu"]
    base = build_model(size, seed).to(dev)
    models = {"eager": base, "torchfuser": optimize(copy.deepcopy(base), backend=backend)}
    if dev.type == "cuda":
        models[GRAPHED] = optimize(copy.deepcopy(base), backend=backend, cuda_graphs=True)
    params = sum(p.numel() for p in base.parameters())
    console.print(f"[bold]TorchFuser demo[/] on {dev}: Llama-style, {size.layers} layers, hidden {size.hidden}, "
                  f"{params / 1e6:.1f}M parameters, batch {size.batch}×{size.seq} tokens, {steps} steps")
    console.print(report(models["torchfuser"]))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        if dev.type != "cuda":
            results = train(models, size, steps, dev, seed, progress)
        else:  # GPU timings are steady; one model on the device at a time keeps each peak memory its own
            for model in models.values():
                model.cpu()
            results = {}
            for name, model in models.items():
                model.to(dev)
                results.update(train({name: model}, size, steps, dev, seed, progress))
                model.cpu()
                torch.cuda.empty_cache()
    if GRAPHED in results:  # graph replays restore their saved tensors without the hooks: no count
        results[GRAPHED]["saved_bytes"] = None
    _print_summary(console, results, size)
    if (held := _held_note(dev, backend)) is not None:
        console.print(held, markup=False)  # `pip install ".[mlir]"`: brackets rich would take for markup
    for note in report(models[GRAPHED]).notes if GRAPHED in models else ():
        if "layer calls replayed" in note:
            console.print(note)
    return results


def _held_note(dev, backend) -> str | None:
    """What the torchfuser column ran, where the default has no compiled backend on this device (CI's plain
    wheel: no torch-mlir): the blocks no faster on the reference backend stayed PyTorch's (backends/policy.py)."""
    from torchfuser.backends import policy, unavailable_reason

    if policy.held(backend, dev) is None:
        return None
    return (f"torchfuser here: no compiled CPU backend ({unavailable_reason('mlir', 'cpu')}), so only "
            f"{', '.join(sorted(policy.KEPT_WITHOUT_COMPILER))} is fused (its reference kernel is faster than "
            "PyTorch's); the other blocks stay PyTorch's (see the report)")


def _mib(n):
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def _print_summary(console, results, size):
    eager = results["eager"]
    others = [r for r in results.values() if r is not eager]
    table = Table(title="eager vs torchfuser", title_justify="left")
    for name in ("", *results):
        table.add_column(name, justify="right")
    tokens = size.batch * size.seq
    table.add_row("first / last loss", *[f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f}" for r in results.values()])
    table.add_row("step time (median)", f"{eager['step_s'] * 1e3:.1f} ms",
                  *[f"{r['step_s'] * 1e3:.1f} ms, {eager['step_s'] / r['step_s']:.2f}× speed-up" for r in others])
    table.add_row("tokens/s", *[f"{tokens / r['step_s']:,.0f}" for r in results.values()])
    for label, key in (("saved activations", "saved_bytes"), ("peak memory", "peak_bytes")):
        if eager[key] is not None:
            table.add_row(label, _mib(eager[key]), *["n/a" if r[key] is None else f"{_mib(r[key])}, {r[key] / eager[key]:.2f}×"
                                                     for r in others])
    console.print(table)
    for name, r in results.items():
        if r is not eager:
            drift = max(abs(a - b) / abs(a) for a, b in zip(eager["losses"], r["losses"]))
            console.print(f"loss parity, {name}: largest relative difference per step {drift:.2e} over {len(r['losses'])} steps")
