"""``cuda_graphs="auto"`` (optimize's default): graphs per stack only where they are safe and measured faster.

On a CUDA device every stack of fused layers is routed through a ``Stack`` as with ``cuda_graphs=True``,
with an ``Auto`` policy that changes three things:

1. Timing. The stack's first ``WARM`` training steps run eagerly, untimed (kernels compile, the allocator
   settles); the next ``TIMED`` run eagerly and are timed; then the graphs are captured (that step is not
   timed) and the next ``TIMED`` steps replay, timed. A step's time is the GPU-timeline interval between
   CUDA events recorded as layer 0 starts one training call and the next (the whole step: forward,
   backward, optimizer, data, whatever the host makes the GPU wait for), per token. Events are only
   queried (never synchronized): a step's interval is read once its closing event has completed, a step
   or two later. The median replayed time must beat the median eager time by ``MARGIN``, and the memory
   the graphs hold must stay under ``MEMORY_FRACTION`` of the device's, for the graphs to stay; otherwise
   the stack goes eager for good and its pool is freed. The report gives both times and the decision.

2. Safety. Calls that ``cuda_graphs=True`` replays with caveats its user accepted run eagerly instead:
   - ``output_hidden_states`` / ``output_attentions`` (transformers' output capturing active, or set in
     the model's config) and any forward hook on a layer: a replay's outputs are views of the graph's
     buffers, which the next replay overwrites; a hook or the output tuple could keep them.
   - inference calls (no grad: ``generate``, evaluation) after training calls have been seen: the stack
     goes eager for good and frees its pool, so the memory the graphs hold between steps is never held
     through a generation (a GRPO loop), and no capture is repeated after each one.
   - a second backward through one forward (``retain_graph=True``) or a backward with ``create_graph``:
     found on the eager steps before capture (a gradient hook on the last layer's output, ``watch``),
     the stack goes eager for good. After capture it still raises (the replay's saved
     activations are gone), and the stack goes eager for good, so the step can be run again.
   - a stack none of whose first ``IDLE`` training calls could be replayed (a KV cache in every training call,
     hooks kept on a layer) stops checking each call: eager for good.
   - an output a replay handed out still referenced when the next step's first replay comes (hidden
     states a model collects itself, a variable): that call runs eagerly, and the stack eager for good.
   Everything ``cuda_graphs=True`` already runs eagerly (no grad, gradient checkpointing, torch.compile,
   packed rows, hooks inside the layers, KV caches, FSDP2, sharded or wrapped parameters) stays so.

3. Bounds. Graphs are only captured where the kept sets of graphs fit ``MEMORY_FRACTION`` of the device's
   memory (``GraphOptions.pool_gib``), and the stack's own churn rule still turns capturing off.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

WARM = 1  # eager training steps before timing
TIMED = 3  # steps timed per mode
IDLE = 16  # training calls of layer 0 that could not be replayed, before any could: then eager for good
MARGIN = 0.03  # replayed steps must be this much faster than eager ones
MEMORY_FRACTION = 0.25  # of the device's memory, at most, held by a stack's graphs
EAGER_TIMING = "auto: timing eager steps before trying graphs"
RELEASED = "auto chose eager for good (the reason is given above)"


class CudaClock:
    """Marks on the current CUDA stream, read without synchronizing."""

    @staticmethod
    def mark():
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    @staticmethod
    def done(mark) -> bool:
        return mark.query()

    @staticmethod
    def ms(start, end) -> float:
        return start.elapsed_time(end)


def device_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def available_bytes() -> int:
    """Free device memory plus what the caching allocator holds unused (no stream sync)."""
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def allocated() -> int:
    return torch.cuda.memory_allocated()


@dataclass(eq=False)
class Auto:
    """One stack's automatic choice. ``step`` is called at each training call of layer 0 and says how
    that step runs; ``decision`` is None until the stack has chosen, then the reason of its choice."""

    clock: object = field(default_factory=lambda: CudaClock())  # looked up at each Auto (tests swap it)
    warm: int = WARM
    timed: int = TIMED
    steps: int = 0  # training steps seen (layer-0 training calls)
    marks: list = field(default_factory=list)  # (mark, mode, tokens), oldest first, not yet read
    times: dict = field(default_factory=lambda: {"eager": [], "graphs": []})  # ms per 1k tokens
    decision: str | None = None
    kept: bool | None = None  # the choice: True graphs, False eager for good, None undecided
    idle: int = 0  # layer-0 training calls that ran eagerly for a reason of their own before any step was timed
    activations: int = 0  # the most memory an eager forward of the stack added (what a set of graphs holds)
    grad_bytes: int = 0  # the stack's trainable parameters' gradients, which a capture allocates in its pool

    def mode(self) -> str:
        """How the next step runs: "eager" (timed or not) or "graphs"."""
        if self.kept is not None:
            return "graphs" if self.kept else "eager"
        return "eager" if self.steps < self.warm + self.timed else "graphs"

    def step(self, tokens: int) -> str:
        """Layer 0's training call begins a step: read what completed, mark this one; its mode."""
        self.read()
        mode = self.mode()
        if self.kept is None:
            label = ("warm" if self.steps < self.warm else "eager" if self.steps < self.warm + self.timed
                     else "capture" if self.steps == self.warm + self.timed else "graphs")
            self.marks.append((self.clock.mark(), label, tokens))
        self.steps += 1
        return mode

    def read(self) -> None:
        """Intervals whose closing mark has completed, in order (a completed mark implies the earlier)."""
        while len(self.marks) >= 2 and self.clock.done(self.marks[1][0]):
            (start, label, tokens), (end, _, _) = self.marks[0], self.marks[1]
            if label in self.times:
                self.times[label].append(self.clock.ms(start, end) * 1000 / max(tokens, 1))
            self.marks.pop(0)

    def ready(self) -> bool:
        """Whether enough replayed steps have been read to choose."""
        if self.kept is None:
            self.read()
        return self.kept is None and len(self.times["graphs"]) >= self.timed

    def choose(self, held: int, bound: int) -> bool:
        """Keep the graphs (True) or go eager for good (False); ``held``: bytes the graphs hold."""
        eager, graphs = statistics.median(self.times["eager"]), statistics.median(self.times["graphs"])
        times = f"{graphs:.3g} ms replayed against {eager:.3g} ms eager per 1k tokens (medians of {self.timed} steps)"
        if held > bound:
            self.give_up(f"the graphs hold {held / 2**30:.2f} GiB, over the bound of {bound / 2**30:.2f} GiB; {times}")
        elif graphs > eager * (1 - MARGIN):
            self.give_up(f"replay is not {MARGIN:.0%} faster: {times}")
        else:
            self.kept, self.decision = True, f"graphs kept: {times}, {held / 2**30:.2f} GiB held"
            self.marks.clear()
        return bool(self.kept)

    def fits(self, available: int, bound: int) -> bool:
        """Before the first capture: whether a set of graphs (about the eager forward's activations, with
        headroom for its gradients and scratch) fits in ``available`` bytes and the bound; else eager for good."""
        need = int(1.5 * self.activations) + self.grad_bytes
        if need > min(available, bound):
            where = "the bound" if bound <= available else "the free device memory"
            self.give_up(f"the graphs would hold about {need / 2**30:.2f} GiB (1.5 × an eager forward's "
                         f"activations and the layers' gradients), more than {where} "
                         f"({min(available, bound) / 2**30:.2f} GiB)")
            return False
        return True

    def give_up(self, why: str) -> None:
        self.kept, self.decision = False, f"eager for good: {why}"
        self.marks.clear()

    def describe(self) -> str:
        if self.decision is not None:
            return self.decision
        done = {k: len(v) for k, v in self.times.items()}
        return (f"deciding ({self.steps} training steps seen; timed {done['eager']} eager and {done['graphs']} "
                f"replayed of {self.timed} each)")


_CAPTURING = []  # transformers' output-capturing module, looked up once (None: not there)


def _collector():
    if not _CAPTURING:
        try:
            from transformers.utils import output_capturing
        except ImportError:  # transformers without output capturing
            output_capturing = None
        _CAPTURING.append(getattr(output_capturing, "_active_collector", None))
    var = _CAPTURING[0]
    return None if var is None else var.get()


try:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_callback
except ImportError:  # a build without dynamo
    _dynamo_callback = None


def under_compile() -> bool:
    """Whether this call runs inside a torch.compile'd call (an eager part between graph breaks): dynamo's
    frame callback is set there, and nowhere else."""
    return _dynamo_callback is not None and bool(_dynamo_callback())


def outputs_requested(model_config) -> str | None:
    """Why a call's layer outputs could be kept past the next replay (None: they are not)."""
    collector = _collector()
    if collector:
        wanted = [k for k in collector if not k.startswith("_")]  # hidden_states, attentions, router_logits, …
        if wanted:
            return f"output_{wanted[0]} requested: the outputs would be views the next replay overwrites"
    for name in ("output_hidden_states", "output_attentions"):
        if getattr(model_config, name, False):
            return f"config.{name} is True: the outputs would be views the next replay overwrites"
    return None


def foreign_hooks(layer) -> bool:
    """Forward hooks on the layer itself other than transformers' output capturing (inactive unless
    requested, which ``outputs_requested`` sees): a hook could keep an output the next replay overwrites."""
    hooks = [*layer._forward_hooks.values(), *layer._forward_pre_hooks.values()]
    return any("output_capturing" not in getattr(h, "__qualname__", "") for h in hooks) or bool(
        layer._backward_hooks or layer._backward_pre_hooks)


def watch(auto: Auto, t: torch.Tensor) -> None:
    """A hook on the last layer's output in eager timed steps (the output itself untouched): tells ``auto``
    of a second backward through one forward (retain_graph) or a backward that builds a graph (create_graph)."""
    calls = [0]

    def seen(grad):
        calls[0] += 1
        if auto.kept is None and calls[0] > 1:
            auto.give_up("a second backward through one forward (retain_graph=True): a replay's saved "
                         "activations do not survive it")
        elif auto.kept is None and torch.is_grad_enabled():
            auto.give_up("a backward with create_graph=True: a replay's backward cannot be differentiated")

    t.register_hook(seen)


class StackPolicy:
    """What ``Stack`` (replay.py) does for ``cuda_graphs="auto"``: the calls it keeps eager, the step's mode,
    the memory checks, and releasing the graphs for good."""

    def _auto_safe(self, layer) -> str | None:
        """auto: why this call must run eagerly where ``cuda_graphs=True`` would replay it (auto.py)."""
        auto = self.auto
        if auto.kept is False and not self.disabled:
            self.release()
        if self.disabled:
            if auto.kept is not False:  # turned off by the stack itself (capture failed, lengths churned)
                auto.give_up(self.disabled)
            if self.sets or self.retired:
                self._retire()
                self._free_retired()
            return None  # _scan says so
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            return None  # _scan says so (a reentrant checkpoint runs the forward without grad: no inference)
        if not torch.is_grad_enabled():
            if auto.steps:
                auto.give_up("inference calls (no grad: generate, evaluation) run between training steps: the "
                             "graphs' memory would stay held through them")
                self.release()
            return None
        why = outputs_requested(self.config)
        if why is None and under_compile():
            why = "called inside a torch.compile'd call (between graph breaks): the compiler's choice"
        if why is None and foreign_hooks(layer):
            why = "hooks on the layer could keep its outputs, views the next replay overwrites"
        return None if why is None else "auto: " + why

    def _auto_step(self, index: int, tensors) -> str | None:
        """auto: at layer 0, the step's mode (timing, deciding); every layer follows it."""
        auto = self.auto
        if index == 0:
            if auto.ready():
                held = sum(b.bytes for b in self.sets.values())
                if not auto.choose(held, int(MEMORY_FRACTION * device_bytes())):
                    self.release()
                    return self.disabled
            hidden = tensors[0] if tensors else None
            self.mode = auto.step(hidden.shape[:2].numel() if hidden is not None and hidden.dim() >= 2 else 1)
            if self.mode == "eager" and auto.kept is None:
                self.mem0 = allocated()
            elif self.mode == "graphs" and auto.kept is None and not self.sets and not self.captures:
                auto.grad_bytes = sum(p.numel() * p.element_size() for layer in self.layers
                                      for p in layer.parameters() if p.requires_grad)  # as trained now (LoRA: adapters)
                if not auto.fits(available_bytes(), int(MEMORY_FRACTION * device_bytes())):
                    self.release()
                    return self.disabled
        return EAGER_TIMING if self.mode == "eager" else None

    def _probed(self, out):
        """The last layer's eager timed call: its output watched (retain_graph), the forward's memory noted."""
        if self.mem0 is not None:
            self.auto.activations = max(self.auto.activations, allocated() - self.mem0)
            self.mem0 = None
        t = next((o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad), None)
        if t is not None:
            watch(self.auto, t)
        return out

    def _outputs_kept(self, index: int, g) -> bool:
        """Whether an output an earlier step's replay handed out is still referenced. All the stack's graphs
        share one pool, where a layer's scratch may be another's output: the step's first replay (layer 0's)
        checks every output of every set."""
        if index != 0:
            return any(r() is not None for r in g.handed)
        return any(r() is not None for b in self.sets.values() for h in b.graphs for r in h.handed)

    def idle_call(self, why: str) -> None:
        """Layer 0 ran eagerly for ``why`` before any training step counted: after ``IDLE`` such training calls
        (a KV cache passed in every training call, hooks kept on a layer, torch.compile), the stack stops
        checking each call and runs eagerly for good."""
        auto = self.auto
        if auto.kept is None and auto.steps == 0 and torch.is_grad_enabled() and why is not EAGER_TIMING:
            auto.idle += 1
            if auto.idle >= IDLE:
                self.release(f"none of the first {IDLE} training calls could be replayed (the last: {why})")

    def release(self, why: str | None = None) -> None:
        """Eager for good, the graphs' memory freed (once no replay waits for its backward); ``why`` becomes
        the auto decision where none was made yet."""
        if why is not None and self.auto.kept is not False:
            self.auto.give_up(why)
        self.disabled = RELEASED  # the why is the auto decision, said once in the report
        self._retire()
        self._free_retired()

    def _free_retired(self) -> None:
        if not any(b.pending() for b in self.retired):
            for b in self.retired:
                b.graphs = None
            self.retired.clear()
            self.pool = None
