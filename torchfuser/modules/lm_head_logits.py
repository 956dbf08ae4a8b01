"""What ``output.logits`` reads after a fused training call of ``modules.lm_head.FusedLMHeadLoss``: the logits
were never formed, and any use of them says so."""
from __future__ import annotations


class LogitsNotKeptError(AttributeError):
    """Raised on any use of ``output.logits`` after a fused training call (an AttributeError, so that
    ``hasattr`` probes of generic code read False rather than fail)."""


class LogitsNotKept:
    """What ``output.logits`` reads after a fused training call: the logits were never formed. Printing it
    says so; any use (an attribute, indexing, arithmetic, a torch function) raises ``LogitsNotKeptError``
    saying why and what to pass. The output's dict and tuple views leave it out, as they leave out any None
    field, so the readers that walk them (the Trainer, TRL, accelerate, DDP) see no logits."""

    MESSAGE = ("the logits of this training call were never formed: TorchFuser's fused LM head computes the loss "
               "from the final hidden states without them. Pass torchfuser.optimize(model, keep_logits=True) to get "
               "them (one more matmul and the logits' memory), or read them from a call in eval mode or without labels.")

    def __repr__(self) -> str:
        return "<logits not kept: torchfuser.optimize(model, keep_logits=True) keeps them>"

    def __getattr__(self, name):
        raise LogitsNotKeptError(f"outputs.logits.{name}: {self.MESSAGE}")

    def _refuse(self, *args, **kwargs):
        raise LogitsNotKeptError(f"outputs.logits: {self.MESSAGE}")

    __getitem__ = __len__ = __iter__ = __bool__ = __float__ = __array__ = _refuse

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise LogitsNotKeptError(f"{getattr(func, '__name__', func)}(outputs.logits): {cls.MESSAGE}")

    def __reduce__(self):
        return (LogitsNotKept, ())


for _op in ("add", "sub", "mul", "truediv", "floordiv", "matmul", "pow", "mod"):
    setattr(LogitsNotKept, f"__{_op}__", LogitsNotKept._refuse)
    setattr(LogitsNotKept, f"__r{_op}__", LogitsNotKept._refuse)
for _op in ("neg", "abs", "lt", "le", "gt", "ge"):
    setattr(LogitsNotKept, f"__{_op}__", LogitsNotKept._refuse)
NOT_KEPT = LogitsNotKept()
