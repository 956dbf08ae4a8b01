"""q, k, v as one GEMM under autocast (modules/projections.py): same outputs and every gradient
as the separate projections within the docs/numerics.md rule, and the separate path wherever a
projection must run as itself."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from numerics import ATOL, assert_within_rule
from torchfuser.modules import FusedAttention
from torchfuser.modules import gemm, projections
from torchfuser.modules.projections import project

from test_architectures import batch, make


def _linears(bias: bool, sizes=(48, 16, 16), k=32):
    torch.manual_seed(0)
    return nn.ModuleList(nn.Linear(k, n, bias=bias) for n in sizes)


def _run(linears, x, joint: bool):
    """Outputs and the gradients of x and every parameter, for one random upstream gradient each."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=x.dtype != torch.float64):
        ys = project(x, list(linears)) if joint else [m(x) for m in linears]
    g = torch.Generator().manual_seed(3)
    loss = sum((y.double() * torch.randn(y.shape, generator=g, dtype=torch.float64)).sum() for y in ys)
    params = list(linears.parameters())
    grads = torch.autograd.grad(loss, [x, *params])
    return [y.detach() for y in ys] + list(grads)


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])  # how the weights are cast and joined
@pytest.mark.parametrize("bias", [False, True])
def test_one_gemm_matches_float64_within_rule(bias, large, monkeypatch):
    if large:
        monkeypatch.setattr(gemm, "_SMALL_BYTES", 0)
    linears = _linears(bias)
    x = torch.randn(2, 7, 32)
    ref = _run(copy.deepcopy(linears).double(), x.double(), joint=False)
    plain = _run(linears, x, joint=False)
    joint = _run(linears, x, joint=True)
    names = ["q", "k", "v", "dx"] + [n for n, _ in linears.named_parameters()]
    assert len(joint) == len(ref) == len(names)
    for name, j, p, r in zip(names, joint, plain, ref):
        assert j.dtype == p.dtype, name
        assert_within_rule(j, p, r, ATOL[torch.float32], name)


def test_outputs_come_from_one_product():
    linears = _linears(True)
    x = torch.randn(5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = project(x, list(linears))
    assert all(y.dtype == torch.bfloat16 for y in ys)
    assert len({y.untyped_storage().data_ptr() for y in ys}) == 1  # views of one GEMM's output


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _grads(fn, x, params, dtype):
    """The output and the gradients of x and ``params`` under autocast (None: float64, no autocast)."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = fn(x)
    g = torch.Generator(device=x.device).manual_seed(3)
    dy = torch.randn(y.shape, generator=g, device=x.device, dtype=torch.float64)
    return [y.detach(), *torch.autograd.grad((y.double() * dy).sum(), [x, *params])]


@pytest.mark.parametrize("device", DEVICES)
def test_one_autograd_node_matches_float64_within_rule(device):
    """q, k, v under autocast in eager mode: one autograd node whose output and gradients (fp32,
    like the parameters) are within the docs/numerics.md rule of the float64 model, against autocast's own
    nn.Linear calls. On CUDA the gradients come from cuBLAS in fp32 (torch.mm's out_dtype), not
    bf16 products cast afterwards."""
    linears = _linears(True).to(device)
    x = torch.randn(4, 9, 32, device=device)
    fused = lambda x: torch.cat(project(x, list(linears)), -1)  # noqa: E731
    plain = lambda x: torch.cat([m(x) for m in linears], -1)  # noqa: E731
    params = list(linears.parameters())
    ref_linears = copy.deepcopy(linears).double()
    ref = _grads(lambda x: torch.cat([m(x) for m in ref_linears], -1), x.double(), list(ref_linears.parameters()), None)
    got, base = _grads(fused, x, params, torch.bfloat16), _grads(plain, x, params, torch.bfloat16)
    for name, f, p, r in zip(["y", "dx"] + [n for n, _ in linears.named_parameters()], got, base, ref):
        assert f.dtype == p.dtype, name
        assert_within_rule(f, p, r, ATOL[torch.float32], name)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = fused(x.requires_grad_())
    node = y.grad_fn.next_functions[0][0].next_functions[0][0]  # cat <- split <- the product
    assert "_AutocastLinear" in type(node).__name__
    if device == "cuda" and hasattr(torch.ops.aten.mm, "dtype"):
        assert projections._out_dtype_ok(x.device)  # the fp32-output products are the ones in use


def test_one_node_computes_only_the_gradients_asked_for(monkeypatch):
    """Frozen weights get no product for their gradients; an input without grad gets no dx; a
    frozen projection beside a trained one gets None while the other gets its slice."""
    products = []
    real = gemm.mm
    monkeypatch.setattr(gemm, "mm", lambda a, b, dtype: products.append(tuple(a.shape)) or real(a, b, dtype))
    a, b = _linears(True, sizes=(24, 8))
    x = torch.randn(5, 32, requires_grad=True)

    def backward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.cat(project(x, [a, b]), -1)
        y.sum().backward()

    for p in (*a.parameters(), *b.parameters()):
        p.requires_grad_(False)
    backward(x)
    assert products == [(5, 32)] and x.grad is not None  # dx only
    products.clear()
    b.weight.requires_grad_(True)
    backward(x.detach())
    assert products == [(32, 5)]  # dW only
    assert a.weight.grad is None and b.weight.grad.dtype == torch.float32 and b.weight.grad.shape == (8, 32)
    assert a.bias.grad is None and b.bias.grad is None


def test_a_single_projection_runs_as_itself():
    m = nn.Linear(32, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert projections.joint(torch.randn(3, 32), [m]) is None


@pytest.mark.parametrize("device", DEVICES)
def test_residual_plus_projection_matches_float64_within_rule(device):
    """r + down(x) under autocast as one node (the MLP's last residual add): the sum and every
    gradient (r's, x's, the fp32 weight's) within the docs/numerics.md rule of the float64 computation,
    against autocast's ``r + nn.Linear(x)``. On CUDA the sum comes from cuBLAS's epilogue and the
    weight's gradient in fp32 straight from the product."""
    torch.manual_seed(4)
    down = nn.Linear(40, 24, bias=False).to(device)
    r = torch.randn(3, 7, 24, device=device, requires_grad=True)
    x = torch.randn(3, 7, 40, device=device)
    fused = lambda x: projections.residual_linear(r, x, down)  # noqa: E731
    plain = lambda x: r + down(x)  # noqa: E731
    ref_down = copy.deepcopy(down).double()
    ref_r = r.detach().double().requires_grad_()
    ref = _grads(lambda x: ref_r + ref_down(x), x.double(), [ref_r, ref_down.weight], None)
    got, base = (_grads(f, x, [r, down.weight], torch.bfloat16) for f in (fused, plain))
    for name, f, p, want in zip(["y", "dx", "dr", "dW"], got, base, ref):
        assert f.dtype == p.dtype, name
        assert_within_rule(f, p, want, ATOL[torch.float32], name)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert "_ResidualLinear" in type(fused(x).grad_fn).__name__
    if device == "cuda" and hasattr(torch.ops.aten.addmm, "dtype"):
        assert projections._out_dtype_ok(x.device)  # the epilogue's sum is the one in use


def test_residual_plus_projection_only_where_it_is_the_same_computation():
    r, x = torch.randn(2, 24), torch.randn(2, 40)
    down, biased = nn.Linear(40, 24, bias=False), nn.Linear(40, 24)
    assert projections.residual_linear(r, x, down) is None  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert projections.residual_linear(r, x, down) is not None
        assert projections.residual_linear(r, x, biased) is None
        assert projections.residual_linear(r.bfloat16(), x, down) is None
        assert projections.residual_linear(r[:1], x, down) is None  # would broadcast
        down.register_forward_hook(lambda *a: None)
        assert projections.residual_linear(r, x, down) is None


def test_the_layers_last_add_runs_inside_the_down_projection():
    """Under autocast a fused Llama layer ends in that node; with the MLP hooked, or its forward
    replaced on the instance, it calls the MLP."""
    model = torchfuser.optimize(make("llama"))
    layer = model.model.layers[0]
    ids = batch(padded=False)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, output_hidden_states=True).hidden_states[1]
    assert "_ResidualLinear" in type(out.grad_fn).__name__
    calls = []
    handle = layer.mlp.register_forward_hook(lambda *a: calls.append("hook"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    handle.remove()
    inner = layer.mlp.forward
    layer.mlp.forward = lambda x: calls.append("forward") or inner(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    assert calls == ["hook", "forward"]


def _separate(linears, x) -> bool:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = project(x, list(linears))
    return len({y.untyped_storage().data_ptr() for y in ys}) == len(ys)


def test_separate_without_autocast_with_hooks_or_other_modules():
    linears, x = _linears(True), torch.randn(5, 32)
    ys = project(x, list(linears))
    assert all(torch.equal(y, m(x)) for y, m in zip(ys, linears))  # no autocast: each module as is
    seen = []
    handle = linears[1].register_forward_hook(lambda m, i, o: seen.append(o))
    assert _separate(linears, x) and len(seen) == 1  # the hook fired
    handle.remove()
    handle = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert _separate(linears, x)
    finally:
        handle.remove()

    class LoRALike(nn.Linear):
        pass

    mixed = nn.ModuleList([*linears[:2], LoRALike(32, 16)])
    assert _separate(mixed, x)
    mixed_bias = nn.ModuleList([*linears[:2], nn.Linear(32, 16, bias=False)])
    assert _separate(mixed_bias, x)
    assert not _separate(linears, x)


# qwen2: q, k, v with biases; phi3: one fused gate_up projection (packed without autocast too)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_model_under_autocast_matches_float64_within_rule(arch, monkeypatch):
    """Loss and every gradient of a fused tiny model under bf16 autocast, against the float64
    model, within twice the error of the unfused model under the same autocast; the gated MLPs
    take the packed [gate | up] path."""
    ids, mask, labels = batch(padded=False)  # fully masked rows give NaN in the float64 eager model
    ref, plain = make(arch).double(), make(arch)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused)  # the CPU default backend: MLIR kernels
    assert any(isinstance(m, FusedAttention) for m in fused.modules())
    # Where the layer's residual adds are fused, its norms hand the projections bf16, as autocast would.
    seen = []
    attention = next(m for m in fused.modules() if isinstance(m, FusedAttention))
    attention.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["hidden_states"].dtype), with_kwargs=True)
    layers = torchfuser.report(fused).counts().get("residual_norm", {}).get("fused", 0)
    packed_calls = []
    real = torchfuser.ops.swiglu_packed
    # counted in the forward (the backward makes each h again under no_grad: modules.recompute)
    monkeypatch.setattr(torchfuser.ops, "swiglu_packed",
                        lambda *a: (torch.is_grad_enabled() and packed_calls.append(1)) or real(*a))
    results = []
    for model, dtype in ((ref, None), (plain, torch.bfloat16), (fused, torch.bfloat16)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert len(packed_calls) == 2  # both layers' MLPs, under autocast
    assert seen == [torch.bfloat16 if layers else torch.float32]
    names = ["loss"] + [n for n, _ in plain.named_parameters()]
    for name, r, p, f in zip(names, *results):
        assert_within_rule(f, p, r, ATOL[torch.bfloat16], name)


def test_joint_projections_compile_fullgraph_under_autocast():
    """The hook and autocast checks trace: torch.compile(fullgraph=True) of a fused model under
    autocast has no graph break and gives the eager fused loss and gradients."""
    ids, _, labels = batch(padded=False)
    eager = make("qwen2")
    torchfuser.optimize(eager, backend="reference")
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    losses = []
    for model in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    # Same math, same dtypes; the compiled graph's decompositions may round differently in bf16.
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=2e-2, atol=1e-3, msg=name)
