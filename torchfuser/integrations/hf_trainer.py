"""A Hugging Face Trainer callback that fuses the Trainer's model before training starts."""
from __future__ import annotations

import logging
import weakref

from transformers import TrainerCallback

from torchfuser import head_check, unwrap, walker
from torchfuser.api import _check_not_flattened, optimize, report

log = logging.getLogger("torchfuser")


class TorchFuserCallback(TrainerCallback):
    """``Trainer(..., callbacks=[TorchFuserCallback()])`` (keywords are optimize's).

    Optimizes the model at the end of ``Trainer.__init__``: before the optimizer is created
    and before the model is wrapped for distributed training. A model the Trainer gets later
    (``model_init`` builds one at each ``train()`` and each search trial) is optimized at the
    start of its training, once the optimizer is built. Parameters stay the same objects, so
    an optimizer built earlier keeps valid references, and checkpoints keep the original
    ``state_dict`` keys (they load into plain ``transformers``).

    The report is printed on the main process when a model is fused (once for models that fuse
    alike, as model_init's do), unless ``verbose=False`` or ``TrainingArguments.log_level`` is
    "error" or "critical"; it is also logged at INFO and kept in ``callback.report``. (``verbose`` is
    the callback's: optimize's own would print on every process.)

    A model optimized already keeps its settings: the callback passes ``optimize`` only the keywords it
    was given. Which LM head runs is checked again when training begins (TRL's trainers put their own
    fused head on the model after this callback ran) and after the first training step (a trainer that
    computes its loss without calling the model with labels never runs the fused one): where the fused
    LM head + loss is bypassed, a warning says which head runs and the report, printed again, lists it so.
    """

    def __init__(self, *, verbose: bool = True, **optimize_kwargs):
        self.optimize_kwargs = optimize_kwargs
        self.verbose = verbose
        self.report = None  # of the latest model fused
        self._printed = None  # the summary printed last: a model_init run that fuses alike prints nothing new
        self._done = weakref.WeakSet()  # a Trainer with model_init builds a new model per run and trial
        self._steps_checked = weakref.WeakSet()  # models whose fused LM head was checked after a training step

    def _fuse(self, model, args, state) -> None:
        if model is None or any(m in self._done for m in model.modules()):
            return  # fused already, perhaps inside a wrapper (with FSDP the Trainer's model is the wrapper)
        try:
            _check_not_flattened(model)
        except ValueError as err:  # model_init's model, wrapped by the Trainer before training begins
            log.warning("torchfuser: the model is left unfused (with model_init, call torchfuser.optimize in it): %s", err)
            return
        optimize(model, **self.optimize_kwargs)
        self._done.add(model)
        self._tell(model, args, state)

    def _tell(self, model, args, state) -> None:
        """Keep the model's report, log it, and print it where it says something new."""
        self.report = report(model)
        if state is None or state.is_world_process_zero:
            log.info("torchfuser: %s", self.report.summary())
            log.debug("%s", self.report)
            if self.verbose and not _quiet(args) and self._printed != self.report.summary():
                _print(self.report)
                self._printed = self.report.summary()

    def _check_head(self, model, args, state) -> None:
        """Say so where the fused LM head + loss no longer runs (a trainer's own head computes the loss)."""
        if model is None or unwrap.optimized(model)[1] is None:
            return
        now = report(model)
        if self.report is not None and now.summary() == self.report.summary():
            return  # the same blocks run fused as when it was told
        for note in now.notes if state is None or state.is_world_process_zero else ():
            if note.startswith(head_check.HEAD + "bypassed"):
                log.warning("torchfuser: %s", note)
        self._tell(model, args, state)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._fuse(model, args, state)
        if self.optimize_kwargs.get("cuda_graphs") and _data_parallel(args):
            log.warning("torchfuser: the Trainer will wrap the model in nn.DataParallel (%d GPUs, no launcher): its "
                        "replicas run the layers without CUDA graphs; launch with torchrun for DDP, which keeps them",
                        args.n_gpu)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A model swapped into the Trainer after __init__, or built by its model_init at each train(),
        # is fused here (the optimizer already holds its parameters: the same objects after fusing).
        self._fuse(model, args, state)
        self._check_head(model, args, state)  # TRL's trainers put their own head on the model after __init__

    def on_step_end(self, args, state, control, model=None, **kwargs):
        # After the first step: a fused head that made no call is bypassed by the trainer's own loss.
        if model is None or model in self._steps_checked or getattr(args, "torch_compile", False):
            return  # compiled calls are not counted
        self._steps_checked.add(model)
        _, target = unwrap.optimized(model)
        st = walker.state(target) if target is not None else None
        if st is None:
            return
        idle = False
        for fused in head_check.fused_heads(target, st).values():
            if fused.calls.n == 0:
                fused.idle_steps = state.global_step if state is not None else 1
                idle = True
        if idle:
            self._check_head(model, args, state)


def _print(report) -> None:
    from rich.console import Console

    console = Console()
    if not (console.is_terminal or console.is_jupyter):  # a log file: rich's 80 columns would fold every name
        console = Console(width=160)
    console.print(report)


def _quiet(args) -> bool:
    """Whether the user asked this process's logs for errors only (``log_level="error"``)."""
    level = getattr(args, "get_process_log_level", None)
    try:
        return callable(level) and level() > logging.WARNING
    except Exception:  # a stand-in args object: no opinion
        return False


def _data_parallel(args) -> bool:
    """Whether the Trainer will use nn.DataParallel: several GPUs visible and no distributed launch."""
    return getattr(args, "n_gpu", 1) > 1 and getattr(args, "local_rank", -1) == -1

