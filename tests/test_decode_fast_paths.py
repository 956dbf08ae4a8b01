"""The decode step's shortcuts (host time, NOTES-trl.md "Rollouts with generate") keep the calls they skip
whenever those would do something: a Linear with hooks (its own or global) or a forward of its own is called as a
module; a no-grad op call with an empty tensor, a tensor subclass or a dispatch mode goes the general way."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchfuser import ops
from torchfuser.modules.projections import call_linear, project
from torchfuser.ops import _call


def _linear(bias: bool = True) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Linear(8, 6, bias=bias)


def test_call_linear_equals_the_module_call():
    x = torch.randn(3, 8)
    for bias in (True, False):
        m = _linear(bias)
        assert torch.equal(call_linear(m, x), m(x))


def test_call_linear_runs_the_module_s_own_hooks_and_forward():
    x = torch.randn(3, 8)
    m = _linear()
    seen = []
    handle = m.register_forward_hook(lambda mod, args, out: seen.append("hook") or out * 2)
    assert torch.equal(call_linear(m, x), 2 * nn.functional.linear(x, m.weight, m.bias)) and seen == ["hook"]
    handle.remove()
    handle = m.register_forward_pre_hook(lambda mod, args: (args[0] * 0,))
    assert torch.equal(call_linear(m, x), m.bias.expand(3, 6))
    handle.remove()
    m.forward = lambda t: t.sum(-1, keepdim=True)  # a forward set on the instance
    assert call_linear(m, x).shape == (3, 1)


def test_call_linear_runs_global_hooks():
    x = torch.randn(3, 8)
    m, seen = _linear(), []
    handle = nn.modules.module.register_module_forward_hook(lambda mod, args, out: seen.append(type(mod)))
    try:
        project(x, [m, _linear()])  # no autocast: each projection called
    finally:
        handle.remove()
    assert seen == [nn.Linear, nn.Linear]


def test_call_linear_of_a_subclass_or_a_weight_held_elsewhere_is_the_module_call():
    class Scaled(nn.Linear):
        def forward(self, t):
            return super().forward(t) * 3

    x = torch.randn(3, 8)
    s = Scaled(8, 6)
    assert torch.equal(call_linear(s, x), s(x)) and torch.equal(s(x), 3 * nn.functional.linear(x, s.weight, s.bias))
    m = _linear()
    w = m.weight.detach().clone() * 5
    del m.weight
    m.weight = w  # a plain attribute (as old weight_norm does): not in _parameters
    assert torch.equal(call_linear(m, x), nn.functional.linear(x, w, m.bias))


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_no_grad_op_calls_take_the_general_way_where_they_must(monkeypatch):
    w = torch.randn(16)
    asked = []
    monkeypatch.setattr(_call, "nograd_forward", lambda name, args: asked.append(args[-1]) or (args[0], None))
    with torch.no_grad():
        ops.rms_norm(torch.randn(2, 16), w, 1e-6, 0.0, "reference")
        assert asked == ["reference"]  # the shortcut
        empty = ops.rms_norm(torch.randn(0, 16), w, 1e-6, 0.0, "mlir")  # empty: for_empty's reference backend first
        assert empty.shape == (0, 16) and asked == ["reference", "reference"]
        with _Seen() as mode:  # a dispatch mode sees the custom op
            ops.rms_norm(torch.randn(2, 16), w, 1e-6, 0.0, "reference")
        assert any("rms_norm_fwd" in str(f) for f in mode.ops) and len(asked) == 2
    assert _call._plain_rows((torch.randn(2, 3), w, 1e-6, "reference"))
    assert not _call._plain_rows((torch.randn(0, 3), w, 1e-6, "reference"))
    assert not _call._plain_rows((torch.randn(2, 3).as_subclass(_Sub), w, 1e-6, "reference"))
    assert not _call.plain_eager((torch.randn(2, 3).as_subclass(_Sub), 1e-6))
    assert _call.plain_eager((torch.randn(2, 3), torch.float32, None, 1, "x"))


class _Sub(torch.Tensor):
    pass


def _tiny():
    from test_decode_host_calls import _pair  # the tiny Llama pair (2 layers), built without the global generator
    return _pair("reference")


def test_the_fused_layer_calls_its_attention_s_forward_only_where_no_hook_would_run():
    base, fused = _tiny()
    ids = torch.randint(4, 1024, (2, 5), generator=torch.Generator().manual_seed(0))
    attention = fused.model.layers[0].self_attn
    calls = []
    original = type(attention).forward

    def spy(self, *args, **kwargs):
        calls.append("forward")
        return original(self, *args, **kwargs)

    attention.forward = spy.__get__(attention)  # a forward on the instance is what the layer runs
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, base(ids).logits) and calls == ["forward"]
        del attention.forward
        seen = []
        handle = attention.register_forward_hook(lambda mod, args, out: seen.append("own"))
        fused(ids)
        handle.remove()
        glob = nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: seen.append("global") if mod is attention else None)
        try:
            fused(ids)
        finally:
            glob.remove()
        assert seen == ["own", "global"]
        fused(ids)
        assert seen == ["own", "global"]  # removed: not called


def test_reference_rope_infer_gives_rope_fwd_s_bits():
    """The no-grad rope (roll and a sign moved into sin) against the forward kernel, bit for bit: full and partial
    rotary, odd widths, casts, fp64, a single row, and B×S×H×D-laid (transposed) inputs as the attention passes."""
    from torchfuser.backends.reference.rope import rope_fwd, rope_infer

    gen = torch.Generator().manual_seed(0)
    cases = [((2, 5, 4, 32), (2, 5, 32), torch.float32, torch.float32), ((1, 1, 2, 8), (1, 1, 8), torch.float32, torch.float32),
             ((2, 3, 4, 32), (2, 3, 16), torch.float32, torch.float32), ((2, 3, 2, 7), (2, 3, 7), torch.float32, torch.float32),
             ((2, 3, 4, 16), (2, 3, 16), torch.bfloat16, torch.float32), ((2, 3, 4, 16), (2, 3, 16), torch.float64, torch.float64),
             ((3, 4, 4, 16), (1, 4, 16), torch.float32, torch.float32)]
    for (b, s, h, d), table, dtype, tdtype in cases:
        q = torch.randn(b, s, h, d, generator=gen).to(dtype).transpose(1, 2)
        k = torch.randn(b, s, max(h // 2, 1), d, generator=gen).to(dtype).transpose(1, 2)
        cos, sin = (torch.randn(*table, generator=gen).to(tdtype) for _ in range(2))
        for got, want in zip(rope_infer(q, k, cos, sin), rope_fwd(q, k, cos, sin)):
            assert got.dtype == want.dtype and torch.equal(got, want), (b, s, h, d, table, dtype)
