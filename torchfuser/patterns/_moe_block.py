"""The block-level probe of a mixture-of-experts block (see ``_moe_probe``): its router, its experts
and the block's own composition, each found among the forms ``MoESpec`` describes, then the whole
fused module checked against the block."""
from __future__ import annotations

import torch
from torch import nn

from torchfuser import functional as F
from torchfuser.modules.moe import FusedMoE, MoESpec
from torchfuser.patterns import _probe, _reasons
from torchfuser.patterns import _moe_probe as mp
from torchfuser.patterns.base import Skip

_JITTER_P = 0.1


def _outs(out):
    return list(out) if isinstance(out, tuple) else [out]


def _all_close(a, b) -> bool:
    a, b = _outs(a), _outs(b)
    return len(a) == len(b) and all(isinstance(x, torch.Tensor) and _probe.close(x, y) for x, y in zip(a, b))


class BlockProbe:
    """``run()`` gives the MoESpec of the block, or a Skip saying which part differs."""

    def __init__(self, block, ex_name, router_name, router_copy, rel, bias_name, corr_name, own_corr, e, hidden,
                 layouts, acts, gen):
        self.block, self.ex_name, self.router_name, self.rcopy = block, ex_name, router_name, router_copy
        self.weight_name, self.bias_name, self.corr_name = rel + "weight", bias_name, corr_name
        self.own_corr = own_corr  # the block's own score correction, passed to its router (MiniMax-M2, AFMoE)
        self.e, self.hidden, self.layouts, self.acts, self.gen = e, hidden, layouts, acts, gen
        if own_corr is not None:
            self.own_value = _probe.randn(*getattr(block, own_corr).shape, gen=gen) * 0.5

    def _others(self):
        """(shared expert, its sigmoid gate) among the block's other children with tensors, or a Skip."""
        kids = {n: m for n, m in self.block._modules.items()
                if m is not None and n not in (self.ex_name, self.router_name) and any(True for _ in m.parameters())}
        gates = [n for n, m in kids.items() if type(m) is nn.Linear and m.out_features == 1
                 and m.in_features == self.hidden]
        shared = [n for n in kids if n not in gates]
        if len(shared) > 1 or len(gates) > 1 or (gates and not shared):
            return Skip(f"children besides its router and experts ({_reasons.children(self.block, list(kids))}) that "
                        "are not one shared expert and its gate")
        return (shared[0] if shared else None), (gates[0] if gates else None)

    def _copy(self, experts, dtype, record_router=False):
        """The block's probe copy in ``dtype``: our router copy (recording its calls), ``experts``, stand-ins for the
        shared expert and gate."""
        probe = _probe.shallow_copy(self.block)
        rcopy = mp.tree_copy(self.rcopy)
        for _, owner, leaf, t in list(mp.named_tensors(rcopy)):
            if t.is_floating_point():
                mp.set_tensor(owner, leaf, t.to(dtype))
        probe._modules[self.router_name] = mp.Recorder(None, rcopy) if record_router else rcopy
        if self.own_corr is not None:
            mp.set_tensor(probe, self.own_corr, self.own_value.to(dtype))
        probe._modules[self.ex_name] = experts
        if self.shared is not None:
            probe._modules[self.shared] = mp.StandIn(self.mix_shared)
        if self.gate is not None:
            with torch.device("meta"):
                g = nn.Linear(mp.H_P, 1, bias=self.small_gate.bias is not None)
            g.weight = nn.Parameter(self.small_gate.weight.to(dtype), requires_grad=False)
            if self.small_gate.bias is not None:
                g.bias = nn.Parameter(self.small_gate.bias.to(dtype), requires_grad=False)
            probe._modules[self.gate] = g
        mp.shrink_hidden([probe], self.hidden)
        return probe

    def run(self):
        others = self._others()
        if isinstance(others, Skip):
            return others
        self.shared, self.gate = others
        gen = self.gen
        self.mix_shared = _probe.randn(mp.H_P, mp.H_P, gen=gen)
        if self.gate is not None:
            self.small_gate = _probe.small_projection(self.block._modules[self.gate], mp.H_P, 1, gen)
        recorder = mp.Recorder(_probe.randn(mp.H_P, mp.H_P, gen=gen))
        probe = self._copy(recorder, torch.float64, record_router=True)
        x = _probe.randn(*mp._SHAPE, mp.H_P, gen=gen)
        try:
            with torch.no_grad():
                out = probe(x.clone())
        except Exception as err:
            return Skip(_reasons.failed_probe(self.block, err, "blocks computing router → experts (+ a shared expert)"))
        if len(recorder.calls) != 1:
            return Skip(f"its forward calls its experts {len(recorder.calls)} times, not once")
        call = mp._call_args(self.block._modules[self.ex_name], *recorder.calls[0])
        x2 = x.reshape(-1, mp.H_P)
        if call is None or call[0].shape != x2.shape or not torch.equal(call[0], x2):
            return Skip("its experts are not called as experts(hidden states, indices, weights) on the block's input")
        _, idx, w, order = call
        steps = [lambda: self._router(probe, x2, idx, w),
                 lambda: mp.probe_experts(self.block._modules[self.ex_name], self.layouts, self.acts, self.e,
                                          idx.shape[1], order, self.hidden),
                 lambda: self._composition(probe, out, recorder, x2, w),
                 lambda: self._training(probe, x, out)]
        found = []
        for step in steps:
            got = step()
            if isinstance(got, Skip) or isinstance(got, tuple) and isinstance(got[0], Skip):
                return got if isinstance(got, Skip) else got[0]
            found.append(got)
        (route, router), (experts_fields, experts_probe), shared, jitter = found
        names = experts_fields.pop("names")
        shared_gate = shared["shared_gate"]
        prefix = self.router_name + "."
        keep = [n for n, m in self.block._modules.items() if m is not None
                and n not in (self.ex_name, self.router_name, self.shared, shared_gate)]
        keep += [self.own_corr] if self.own_corr is not None else []
        spec = MoESpec(num_experts=self.e, top_k=idx.shape[1], router=self.router_name,
                       router_weight=prefix + self.weight_name, experts=self.ex_name, gate_up=names["gate_up"],
                       down=names["down"], gate_up_bias=names.get("gate_up_bias"), down_bias=names.get("down_bias"),
                       router_bias=prefix + self.bias_name if self.bias_name else None, shared=self.shared,
                       jitter=jitter, keep=tuple(keep), **router, **shared, **experts_fields, **route)
        return self._whole(spec, experts_probe, x)

    def _router(self, probe, x2, idx, w):
        """(route fields incl. correction, how to call the router and read its logits) matching what the experts
        received; the router is called again as the block called it."""
        wrapper = probe._modules[self.router_name]
        rcopy = wrapper.inner
        calls = wrapper.calls
        if len(calls) != 1 or calls[0][1] or not isinstance(calls[0][0][0], torch.Tensor):
            return Skip("its forward does not call its router once, on the hidden states and tensors of its own")
        first, *extra = calls[0][0]
        own = {id(t): n for n, t in (*probe._parameters.items(), *probe._buffers.items()) if t is not None}
        if any(id(a) not in own for a in extra) or first.reshape(-1, mp.H_P).shape != x2.shape or not torch.equal(
                first.reshape(x2.shape), x2):
            return Skip("its router is called on more than the block's input and tensors of its own")
        call = (tuple(own[id(a)] for a in extra), first.dim() == 2)
        weight, bias = mp.tensor_at(rcopy, self.weight_name), mp.tensor_at(rcopy, self.bias_name)
        ref = nn.functional.linear(x2, weight, bias)
        with torch.no_grad():
            raw = rcopy(first, *extra)
        outs = _outs(raw)
        at = next((i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()
                   and _probe.close(o, ref)), None)
        if at is None:
            return Skip("its router's output holds no logits x·Wᵀ (+ b) of its weight")
        fp32 = outs[at].dtype == torch.float32
        logits = (nn.functional.linear(x2.float(), weight.float(), None if bias is None else bias.float())
                  if fp32 else ref)
        self.logits = outs[at]  # as the router gives them (a block may return them)
        corr = mp.tensor_at(rcopy, self.corr_name) if self.own_corr is None else getattr(probe, self.own_corr)
        n_group = next((v for n, v in _ints(self.block, rcopy) if "group" in n and "topk" not in n and v > 1), 1)
        topk_group = next((v for n, v in _ints(self.block, rcopy) if "group" in n and "topk" in n), 1)
        _, scale = mp.find_attr([rcopy, self.block], "scal", float)  # routed_scaling_factor, route_scale
        for fields, use_corr in mp.route_candidates(n_group, topk_group, scale or 1.0, corr is not None):
            try:
                ours = F.moe_route(logits, idx.shape[1], correction=corr.reshape(-1) if use_corr else None,
                                   backend="reference", **fields)
            except ValueError:
                continue
            if mp.same_routing(ours[1], ours[0], idx, w.to(ours[0].dtype)):
                correction = (self.own_corr or f"{self.router_name}.{self.corr_name}") if use_corr else None
                return {**fields, "correction": correction}, dict(
                    logits_at=at if isinstance(raw, tuple) else None, router_fp32=fp32, router_args=call[0],
                    router_flat=call[1])
        return Skip("its router's top-k is none of softmax, sigmoid (with the score correction and expert groups it "
                    "holds, renormalised or not, scaled or not) or a softmax of the top-k logits")

    def _composition(self, probe, out, recorder, x2, w):
        """The shared gate (or None), what the block returns and how it calls the shared expert, with which its
        output is the experts' plus the shared expert's."""
        outs = _outs(out)
        routed = x2 @ recorder.mix
        flat = True
        if self.shared is None:
            candidates = [(None, routed)]
        else:
            calls = probe._modules[self.shared].calls
            if len(calls) != 1 or calls[0].numel() != x2.numel() or not torch.equal(calls[0].reshape(x2.shape), x2):
                return Skip(f"its shared expert {self.shared!r} is not called once on the block's input")
            flat = calls[0].dim() == 2
            s = mp.StandIn(self.mix_shared)(x2)
            candidates = [(None, routed + s)]
            if self.gate is not None:
                candidates.insert(0, (self.gate, routed + torch.sigmoid(self.small_gate(x2)) * s))
        first = outs[0]
        if not isinstance(first, torch.Tensor) or first.numel() != routed.numel():
            return Skip("its output is not the hidden states (or a tuple of them first)")
        match = next((g for g, y in candidates if _probe.close(first.reshape(routed.shape), y)), "none")
        if match == "none":
            shared = f" plus its shared expert {self.shared!r}" if self.shared else ""
            return Skip(f"its output is not the experts' weighted sum{shared} (a scale, a norm or a residual besides)")
        returns = ["hidden"]
        for extra in outs[1:]:
            if isinstance(extra, torch.Tensor) and extra.shape == w.shape and _probe.close(extra, w):
                returns.append("weights")
            elif isinstance(extra, torch.Tensor) and _probe.close(extra, self.logits):
                returns.append("logits")
            else:
                return Skip("it returns more than the hidden states, the routing weights and the router's logits")
        return dict(shared_gate=match, returns=tuple(returns), shared_flat=flat)

    def _training(self, probe, x, out):
        """The float attribute that jitters the router's input in training (None), or a Skip if training differs."""
        names = [n for n, v in vars(self.block).items() if "jitter" in n and type(v) in (int, float)]
        saved = {n: probe.__dict__[n] for n in names}
        try:
            for m in probe.modules():
                m.training = True
            for p in ([_JITTER_P], [0.0]) if names else ([None],):
                for n in names:
                    probe.__dict__[n] = p[0]
                with torch.no_grad(), _probe.saved_rng():
                    _probe.seed_cpu(0)
                    got = probe(x.clone())
                if _all_close(got, out):
                    return None if p[0] in (None, _JITTER_P) else names[0] if len(names) == 1 else Skip(
                        f"several jitter attributes ({_reasons.quoted(names)})")
        finally:
            for m in probe.modules():
                m.training = False
            probe.__dict__.update(saved)
        return Skip("in training its output differs from eval's (a dropout, noise or another training-only step)")

    def _whole(self, spec, experts_probe, x):
        """``spec`` if the fused module on the fp32 probe copy gives the block's output, eval and training."""
        probe = self._copy(experts_probe, torch.float32)
        x = x.float()
        for training in (False, True):
            fused = FusedMoE(probe, spec, "reference")
            fused.__dict__["_original"] = probe
            for m in (*probe.modules(), *fused.modules()):
                m.training = training
            try:
                with torch.no_grad(), _probe.saved_rng():
                    _probe.seed_cpu(0)
                    want = probe(x.clone())
                    _probe.seed_cpu(0)
                    got = fused(x.clone())
            except Exception as err:
                return Skip(f"the fused MoE ({spec.describe()}) does not run where the block does "
                            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
            if not _all_close(got, want):
                return Skip(f"the fused MoE ({spec.describe()}) differs from the block's own forward "
                            f"{'in training' if training else 'in eval'}")
        return spec


def _ints(*modules):
    for m in modules:
        for name, value in vars(m).items():
            if type(value) is int:
                yield name, value
