"""FSDP on the CPU with gloo. Optimize first, then shard (FSDP2's ``fully_shard``, or FSDP1 with and
without ``use_orig_params``): training goes as for the unfused sharded model, on one rank and on
two. Shard first, then optimize: FSDP2 fuses nothing and says why, FSDP1 is an error that says
what to do."""
from __future__ import annotations

import copy
import datetime
import faulthandler
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules.base import FusedModule

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not (dist.is_available() and hasattr(fsdp, "fully_shard")):
    pytest.skip("torch.distributed FSDP2 (fully_shard) is not available", allow_module_level=True)

VOCAB = 128


def _model():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _shard(model):
    """FSDP2: every decoder layer and the root, on a CPU mesh (without one, fully_shard takes the
    accelerator's: on a GPU machine every rank would move its shards to cuda:0 for gloo)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _wrap_fsdp1(use_orig_params: bool):
    def wrap(model):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        layer = type(model.model.layers[0])
        return fsdp.FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer}),
                                             use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    return wrap


WRAPS = {"fsdp2": _shard, "fsdp1": _wrap_fsdp1(False), "fsdp1-orig-params": _wrap_fsdp1(True)}


def _full_params(model) -> dict:
    if isinstance(model, fsdp.FullyShardedDataParallel):
        with fsdp.FullyShardedDataParallel.summon_full_params(model):
            return {n: p.detach().clone() for n, p in model.named_parameters()}
    model = getattr(model, "module", model)  # DDP
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _train(model, rank: int, steps: int = 2, seq: int = 12, autocast: bool = False):
    """Losses, then every full (all-gathered) parameter after the steps. Plain SGD: a parameter's
    change is its gradient times the rate, so a wrong or unsharded gradient shows undamped."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, _full_params(model)


def _compare(rank: int, backend: str, wrap: str = "fsdp2"):
    base = _model()
    fused = torchfuser.optimize(copy.deepcopy(base), backend=backend)
    keys = list(fused.state_dict())
    assert keys == list(base.state_dict())
    plain_losses, plain_params = _train(WRAPS[wrap](base), rank)
    fused_losses, fused_params = _train(WRAPS[wrap](fused), rank)
    assert fused_losses == pytest.approx(plain_losses, rel=1e-5), wrap
    assert list(fused_params) == list(plain_params)
    for name, want in plain_params.items():
        err = (fused_params[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert err < 1e-5, (wrap, name, err.item())


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_optimize_then_shard_trains_like_unfused(one_rank, backend):
    _compare(0, backend)


def test_shard_then_optimize_fuses_nothing_and_says_why(one_rank):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    want = _shard(_model())(input_ids=ids, labels=ids).loss
    model = _shard(_model())
    with pytest.warns(UserWarning, match="before fully_shard"):
        torchfuser.optimize(model)
    rep = torchfuser.report(model)
    assert rep.entries and all(e.fused is None and "DTensor" in e.reason for e in rep.entries)
    assert not any(isinstance(m, FusedModule) for m in model.modules())
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ValueError, match="DTensor"):
        torchfuser.optimize(_shard(_model()), strict=True)


def test_optimize_inside_fsdp1_says_to_optimize_first(one_rank):
    wrapped = WRAPS["fsdp1"](_model())
    with pytest.raises(ValueError, match="before wrapping it"):
        torchfuser.optimize(wrapped)


def _rank(rank: int, store: str, failures, body, args):
    """One spawned rank: a gloo group of two, then ``body(rank, *args)``; a failure goes to the parent."""
    faulthandler.enable()  # a rank that dies of a signal prints where
    # A rank that fails leaves the other in a collective: the timeout ends it instead of the test's.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    error = None
    try:
        body(rank, *args)
        dist.barrier()
    except BaseException as err:  # reported to the parent, which fails the test
        error = f"rank {rank}: {type(err).__name__}: {err}"
    dist.destroy_process_group()
    if error:
        failures.put(error)
    failures.close()
    failures.join_thread()
    # No interpreter teardown: gloo's threads have aborted it there now and then ("terminate called
    # without an active exception"), failing a run whose every check passed.
    os._exit(0)


def two_ranks(tmp_path, body, *args) -> list[str]:
    """Run ``body(rank, *args)`` (a module-level function) on two spawned CPU ranks; their errors."""
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mp.start_processes(_rank, args=(str(tmp_path / "store"), failures, body, args), nprocs=2,
                               start_method="spawn")
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = env
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    return errors


def _every_wrap(rank: int):
    for wrap in WRAPS:
        _compare(rank, "reference", wrap)


def test_two_ranks_fsdp2_and_fsdp1_train_like_unfused(tmp_path):
    errors = two_ranks(tmp_path, _every_wrap)
    assert not errors, errors
