"""The residual-norm pattern's probe: a layer's forward run on stand-ins for its children (simple random maps
that record how they are called), with a marker object per argument to see where each one arrives
(``patterns.residual_norm`` says what it checks)."""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from torchfuser.patterns import _probe, _residual_output_scale, _residual_tail

_EXTRA = "_torchfuser_probe_extra"
_WIDTH = 8
_KINDS = ("sequential", "parallel", "post", "post_block")


class _Marker:
    """A value the probe passes for one argument, to see where it arrives."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


class _StandIn(nn.Module):
    """Computes ``fn`` and records each call's arguments."""

    def __init__(self, fn, tuple_out: bool = False):
        nn.Module.__init__(self)  # (not super(): in a subclass of the child's class, that class's __init__ is next)
        self.fn, self.tuple_out, self.calls = fn, tuple_out, []
        self.rest = _Marker("attention_rest")  # the attention's second output, to see if the layer returns it
        self.more: tuple = ()  # more outputs after it (JetMoE's attention returns three)
        self.order: list = []  # shared by a run's stand-ins: the order they are called in
        self.flat = False  # returns its output as (rows, width): a MoE block's flattened tokens (Llama 4's)

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        self.order.append(self)
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        y = self.fn(x)
        y = y.reshape(-1, y.shape[-1]) if self.flat else y
        if len(args) == 2 and isinstance(args[1], torch.Tensor) and args[1].shape == y.shape:
            y = y + args[1]  # a block passed the residual adds it itself (BLOOM's attention and MLP, MPT's MLP)
        return (y, self.rest, *self.more) if self.tuple_out else y


_LIKE: dict[type, type] = {}  # the child's class → the stand-in class that is an instance of it too


def _stand_in(child: nn.Module | None, fn, tuple_out: bool) -> _StandIn:
    """A stand-in that is also an instance of ``child``'s class, so that a forward branching on its child's type
    (Ernie 4.5 VL's ``if isinstance(self.mlp, MoeBlock): h, _ = self.mlp(h, token_type_ids)``) takes the branch
    it takes on the real child; a plain ``_StandIn`` where the class changes how attributes or calls work."""
    cls = type(child)
    plain = (child is None or isinstance(child, _StandIn) or cls.__call__ is not nn.Module.__call__
             or cls.__getattr__ is not nn.Module.__getattr__ or cls.__setattr__ is not nn.Module.__setattr__)
    if not plain:
        like = _LIKE.get(cls)
        if like is None:
            try:
                like = type(f"StandIn[{cls.__name__}]", (_StandIn, cls), {"__module__": __name__})
            except TypeError:  # a layout or metaclass conflict
                like = _StandIn
            _LIKE[cls] = like
        try:
            return like(fn, tuple_out)
        except Exception:  # noqa: BLE001 - a property of the class in the way of the stand-in's attributes
            _LIKE[cls] = _StandIn
    return _StandIn(fn, tuple_out)


def _never(x):
    raise RuntimeError("the probe's stand-in for a block the layer leaves alone was called")


class _Probe:
    """The layer's forward run on stand-in children, in training mode. ``roles``: role → child name."""

    def __init__(self, module: nn.Module, roles: dict[str, str]):
        gen = _probe.generator(5)
        a, m = (_probe.randn(_WIDTH, _WIDTH, gen=gen) / _WIDTH**0.5 for _ in range(2))
        self.fns = {
            "norm_in": lambda x: 1.5 * x + 0.25,
            "attention": lambda x: torch.tanh(x) @ a,
            "norm_mid": lambda x: 0.5 - 0.75 * x,
            "mlp": lambda x: torch.sin(x) @ m,
        }
        f1, f2 = (_probe.randn(_WIDTH, _WIDTH, gen=gen) / _WIDTH**0.5 for _ in range(2))
        self.fns.update({"fc_in": lambda x: x @ f1, "fc_out": lambda x: x @ f2})  # an inline MLP's (OPT)
        # norms on a block's output before its residual add (Gemma-2's sandwich)
        self.fns.update({"post_attention_norm": lambda x: 0.8 * x - 0.1, "post_mlp_norm": lambda x: 0.3 - 1.25 * x})
        if "act" in roles:  # inline: the layer's own activation child between its own fc_in and fc_out
            act = module._modules[roles["act"]]
            self.fns["mlp"] = lambda x: self.fns["fc_out"](act(self.fns["fc_in"](x)))
        self.x = _probe.randn(2, 3, _WIDTH, gen=gen)
        m2 = _probe.randn(_WIDTH, _WIDTH, gen=gen) / _WIDTH**0.5  # (drawn after x: the other probes' values as they were)
        self.fns["mlp2"] = lambda x: torch.cos(x) @ m2  # a second MLP block summed with the first (Granite 4's)
        self.fns.update(_residual_tail.fns(gen, _WIDTH))  # a third block's (Gemma 4's per-layer inputs)
        self.fns.update(unused_attention=_never, unused_norm=_never)  # a block run only with encoder states (BART's)
        self.g = _probe.randn(2, 3, _WIDTH, gen=gen)  # the tensor its argument gets
        self.tail_arg = ""  # that argument's name (``_residual_tail.argument``)
        self.module, self.roles = module, roles
        self.last_calls: dict = {}
        self.last_order: list = []  # the stand-ins of the last run, in the order they were called
        self.last_rest = self.markers = None
        self.attention_tuple = True  # the stand-in attention returns (output, weights), as transformers' do
        self.attention_outputs = 2  # how many the stand-in attention returns (as a tuple): 3 for JetMoE's
        self.mlp_tuple = False  # the stand-in MLP returns (output, marker): GPT-OSS's MoE block returns router scores too
        self.mlp_flat = False  # the stand-in MLP's output flattened to (tokens, width) (Llama 4's MoE block)
        self.scales = (1.0, 1.0)  # the blocks' outputs' factors before their adds (``_residual_scale``)
        self.attrs: dict = {}  # attributes set on the probe copy (``_residual_scale`` changes one to see it read)
        self.fixed = _residual_output_scale.neutral(module)  # the layer's own buffers' values on the probe copy

    def dropouts(self) -> tuple[list[str], list[str]]:
        """(nn.Dropout children, float dropout attributes) of the layer itself, and ``config.<name>`` for
        those of its config that its forward reads (Falcon's ``dropout_add(…, self.config.hidden_dropout)``)."""
        children, floats = self._own_dropouts()
        read = []
        for name in self._config_dropouts():  # each alone at 0.5: read if the output is no longer the formula
            out, _ = self.run(0.0, config_p={name: 0.5}, **self.markers)
            read += [f"config.{name}"] if self.kind(self.split(out)[0]) is None else []
        return children, floats + read

    def _own_dropouts(self) -> tuple[list[str], list[str]]:
        children = [n for n, m in self.module._modules.items() if isinstance(m, nn.Dropout)]
        return children, _probe.float_dropouts(self.module)

    def _config_dropouts(self) -> list[str]:
        cfg = getattr(self.module, "config", None)
        return [] if cfg is None or isinstance(cfg, nn.Module) else _probe.float_dropouts(cfg)

    def split(self, out):
        """(the hidden states, whether the layer returns the attention's second output after them: Falcon,
        GPT-J in transformers 5.17 return ``(hidden_states, attn_weights)``)."""
        if isinstance(out, tuple) and len(out) == 2 and out[1] is self.last_rest:
            return out[0], True
        return out, False

    def run(self, p: float = 0.5, config_p: dict | None = None, ps: dict | None = None, **kwargs):
        """(output, the stand-ins' calls by role), every dropout of the layer at ``p`` (those of its config
        too, or as ``config_p`` says); with ``ps``, each at ps[name] (0 if absent; ``config.<field>`` for the
        config's), and the blocks' stand-ins draw from the CPU generator (``drawing``), in the caller's seed."""
        self.markers = kwargs
        if self.tail_arg:
            kwargs = {**kwargs, self.tail_arg: self.g}
        if ps is not None:
            config_p = {n.removeprefix("config."): v for n, v in ps.items() if n.startswith("config.")}
        probe = _probe.shallow_copy(self.module)
        if self._config_dropouts():
            probe.config = copy.copy(self.module.config)
            for name in self._config_dropouts():
                setattr(probe.config, name, p if config_p is None else config_p.get(name, 0.0))
        probe.training = True
        children, floats = self._own_dropouts()
        names = {v for r, v in self.roles.items() if r != "act"}
        for name, child in self.module._modules.items():
            if name not in names and child is not None and not any(True for _ in child.parameters()):
                visible = copy.copy(child)  # in training, whatever it is
                visible.training = True
                if name in children:
                    visible.p = p if ps is None else ps.get(name, 0.0)
                probe._modules[name] = visible
        for name in floats:
            setattr(probe, name, p if ps is None else ps.get(name, 0.0))
        for name, value in {**self.fixed, **self.attrs}.items():
            setattr(probe, name, value)
        fns = self.fns if ps is None else self.drawing()
        stand = {r: _stand_in(self.module._modules.get(self.roles[r]), fns[r],
                              r == "attention" and self.attention_tuple or r == "mlp" and self.mlp_tuple)
                 for r in dict.fromkeys(self.roles)
                 if r not in ("act", "tail_act") and (r != "norm_mid" or self.roles["norm_mid"] != self.roles["norm_in"])}
        probe._modules.update({self.roles[r]: s for r, s in stand.items()})
        if "mlp" in stand:
            stand["mlp"].flat = self.mlp_flat
        self.last_calls = {r: s.calls for r, s in stand.items()}  # read when the forward raises
        self.last_order = order = []
        for role, s in stand.items():
            s.order, s.role = order, role
        self.last_rest = stand["attention"].rest
        stand["attention"].more = tuple(_Marker("attention_more") for _ in range(self.attention_outputs - 2))
        with torch.no_grad(), contextlib.nullcontext() if ps is not None else _probe.saved_rng():
            out = type(self.module).forward(probe, self.x, **kwargs)
        return out, {r: s.calls for r, s in stand.items()}

    def drawing(self) -> dict:
        """The stand-ins, the attention's and the MLP's drawing from the CPU generator as they run: where the
        layer's dropouts draw between or after them shows in the output (its order of draws is checked)."""
        fns = dict(self.fns)
        for role in ("attention", "fc_out" if "act" in self.roles else "mlp"):
            fns[role] = lambda x, f=self.fns[role]: f(x) + 0.25 * torch.rand(x.shape)
        if "act" in self.roles:  # inline (OPT): its fc_out draws
            act = self.module._modules[self.roles["act"]]
            fns["mlp"] = lambda x: fns["fc_out"](act(fns["fc_in"](x)))
        return fns

    def expected(self, kind: str) -> torch.Tensor | None:
        """The formula of ``kind`` on the probe's input, with a third block after it where the layer has one."""
        out = self._expected(kind)
        return out if out is None or "tail_in" not in self.roles else _residual_tail.apply(self, out)

    def _expected(self, kind: str) -> torch.Tensor | None:
        f, x, (ca, cm) = self.fns, self.x, self.scales
        if "mlp2" in self.roles:
            f = dict(f, mlp=lambda t: self.fns["mlp"](t) + self.fns["mlp2"](t))
        mid = f["norm_in"] if self.roles["norm_mid"] == self.roles["norm_in"] else f["norm_mid"]
        sandwich = "post_attention_norm" in self.roles
        if sandwich:  # sequential only
            if kind != "sequential":
                return None
            s = x + f["post_attention_norm"](f["attention"](f["norm_in"](x))) * ca
            return s + f["post_mlp_norm"](f["mlp"](mid(s))) * cm
        if kind == "parallel":
            return x + f["attention"](f["norm_in"](x)) * ca + f["mlp"](mid(x)) * cm
        if kind == "post":  # post-norm (OPT-350m): norm_in after the attention's add, norm_mid after the MLP's
            if (ca, cm) != (1.0, 1.0):
                return None
            h = f["norm_in"](x + f["attention"](x))
            return mid(h + f["mlp"](h))
        if kind == "post_block":  # each block's output normalised, then added (OLMo-2): recognised to say why not fused
            if (ca, cm) != (1.0, 1.0):
                return None
            s = x + f["norm_in"](f["attention"](x))
            return s + mid(f["mlp"](s))
        s = x + f["attention"](f["norm_in"](x)) * ca
        return s + f["mlp"](mid(s)) * cm

    def kind(self, out) -> str | None:
        """Which formula ``out`` is, or None."""
        kinds = _KINDS if self.roles["norm_mid"] != self.roles["norm_in"] else ("parallel",)
        if not isinstance(out, torch.Tensor):
            return None
        return next((k for k in kinds if (want := self.expected(k)) is not None and _probe.close(out, want)), None)


def sandwich_roles(module: nn.Module, attention: str, mlp: str, norms: list[str], params, extra: bool,
                   tail: dict | None = None, tail_arg: str = ""):
    """Roles of a layer with four norms, from the order its forward calls them (stand-ins in any roles): norm_in,
    the attention, post_attention_norm, norm_mid, the MLP, post_mlp_norm (Gemma-2's sandwich); else None. ``tail``:
    the roles of a third block after them, ``tail_arg`` the argument it takes (``_residual_tail``)."""
    roles = dict(attention=attention, mlp=mlp, norm_in=norms[0], norm_mid=norms[1], post_attention_norm=norms[2],
                 post_mlp_norm=norms[3], **(tail or {}))
    probe = _Probe(module, roles)
    probe.tail_arg = tail_arg
    try:
        _run_markers(probe, params, extra)
    except Exception:
        return None
    names = [probe.roles[s.role] for s in probe.last_order if s.role not in _residual_tail.ROLES]
    if len(names) != 6 or names[1] != attention or names[4] != mlp:
        return None
    return dict(attention=attention, mlp=mlp, norm_in=names[0], post_attention_norm=names[2], norm_mid=names[3],
                post_mlp_norm=names[5], **(tail or {}))


def _run_markers(probe: _Probe, params, extra: bool):
    """(output, calls, markers, names left at their default): every argument gets a marker; where that
    makes the forward raise, each argument alone tells which ones must stay at their default."""
    def markers_for(names):
        ms = {n: _Marker(n) for n in names}
        if extra:
            ms[_EXTRA] = _Marker(_EXTRA)
        return ms

    names = [n for n, _ in params]
    try:
        ms = markers_for(names)
        return (*probe.run(**ms), ms, ())
    except Exception:
        pass
    defaulted = []
    for n in names:
        try:
            probe.run(**markers_for([n]))
        except Exception:
            defaulted.append(n)
    if len(defaulted) == len(names):  # nothing to blame on an argument: the forward itself raises
        defaulted = []
    ms = markers_for([n for n in names if n not in defaulted])
    return (*probe.run(**ms), ms, tuple(defaulted))


def _saw_input(probe: _Probe, calls: dict) -> bool:
    """Whether a norm stand-in was called first with the layer's own input (a pre-norm layer's mark)."""
    firsts = [c[0][0] for r in ("norm_in", "norm_mid") for c in calls.get(r, [])[:1] if c[0]]
    return any(isinstance(t, torch.Tensor) and t.shape == probe.x.shape and torch.equal(t, probe.x) for t in firsts)


def _reshapes_attention_input(probe: _Probe, markers: dict) -> bool:
    """Whether the attention gets its input in another shape than the layer's: run on a batch of one,
    where a ``squeeze(0)`` shows (on the probe's batch of two it is a no-op)."""
    x = probe.x
    probe.x = x[:1]
    try:
        _, calls = probe.run(0.0, **markers)
    except Exception:
        return True
    finally:
        probe.x = x
    pos, kw = calls["attention"][0]
    got = pos[0] if pos else next(v for v in kw.values() if isinstance(v, torch.Tensor))
    return got.shape != x[:1].shape


def tail_argument(module: nn.Module, roles: dict, params) -> str | None:
    """The argument a third block takes (``_residual_tail.argument``), read with the roles given (a sandwich's are
    read after it: the run needs it)."""
    return _residual_tail.argument(_Probe(module, roles), params)
