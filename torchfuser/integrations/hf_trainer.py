"""A Hugging Face Trainer callback that fuses the Trainer's model before training starts."""
from __future__ import annotations

import logging
import weakref

from transformers import TrainerCallback

from torchfuser.api import _check_not_flattened, optimize, report

log = logging.getLogger("torchfuser")


class TorchFuserCallback(TrainerCallback):
    """``Trainer(..., callbacks=[TorchFuserCallback(backend="auto")])``.

    Optimizes the model at the end of ``Trainer.__init__``: before the optimizer is created
    and before the model is wrapped for distributed training. A model the Trainer gets later
    (``model_init`` builds one at each ``train()`` and each search trial) is optimized at the
    start of its training, once the optimizer is built. Parameters stay the same objects, so
    an optimizer built earlier keeps valid references, and checkpoints keep the original
    ``state_dict`` keys (they load into plain ``transformers``).
    """

    def __init__(self, **optimize_kwargs):
        self.optimize_kwargs = optimize_kwargs
        self.report = None  # of the latest model fused
        self._done = weakref.WeakSet()  # a Trainer with model_init builds a new model per run and trial

    def _fuse(self, model, state) -> None:
        if model is None or any(m in self._done for m in model.modules()):
            return  # fused already, perhaps inside a wrapper (with FSDP the Trainer's model is the wrapper)
        try:
            _check_not_flattened(model)
        except ValueError as err:  # model_init's model, wrapped by the Trainer before training begins
            log.warning("torchfuser: the model is left unfused (with model_init, call torchfuser.optimize in it): %s", err)
            return
        optimize(model, **self.optimize_kwargs)
        self._done.add(model)
        self.report = report(model)
        if state is None or state.is_world_process_zero:
            log.info("torchfuser: %s", self.report.summary())
            log.debug("%s", self.report)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        self._fuse(model, state)
        if self.optimize_kwargs.get("cuda_graphs") and _data_parallel(args):
            log.warning("torchfuser: the Trainer will wrap the model in nn.DataParallel (%d GPUs, no launcher): its "
                        "replicas run the layers without CUDA graphs; launch with torchrun for DDP, which keeps them",
                        args.n_gpu)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A model swapped into the Trainer after __init__, or built by its model_init at each train(),
        # is fused here (the optimizer already holds its parameters: the same objects after fusing).
        self._fuse(model, state)


def _data_parallel(args) -> bool:
    """Whether the Trainer will use nn.DataParallel: several GPUs visible and no distributed launch."""
    return getattr(args, "n_gpu", 1) > 1 and getattr(args, "local_rank", -1) == -1

