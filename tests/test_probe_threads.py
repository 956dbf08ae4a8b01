"""Matching runs its probes on one thread without changing the process's thread count: a thread started
meanwhile, the caller after, and two threads optimizing at once all keep the count they had."""
from __future__ import annotations

import threading

import pytest
import torch

import torchfuser
from test_optimize import tiny_llama
from torchfuser.patterns import _probe
from torchfuser.patterns.norms import RMSNormPattern


@pytest.fixture(autouse=True)
def _two_threads():
    """At least two intra-op threads, so that a change to one shows (restored after)."""
    n = torch.get_num_threads()
    if n < 2:
        torch.set_num_threads(2)
    yield
    if n < 2:
        torch.set_num_threads(n)


def _in_a_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_matching_leaves_the_process_thread_count_alone(monkeypatch):
    before, fresh = torch.get_num_threads(), _in_a_new_thread(torch.get_num_threads)
    seen, inside, real = [], [], RMSNormPattern.match

    def spy(self, module):
        inside.append(torch.get_num_threads())  # this thread's own count: one while probing, where it can
        seen.append(_in_a_new_thread(torch.get_num_threads))  # a thread started meanwhile: the process's
        return real(self, module)

    monkeypatch.setattr(RMSNormPattern, "match", spy)
    torchfuser.optimize(tiny_llama(), backend="reference")
    assert seen and set(seen) == {fresh}
    assert torch.get_num_threads() == before and _in_a_new_thread(torch.get_num_threads) == fresh
    if _probe._omp_set_num_threads() is not None:  # the speed it is there for (OpenMP builds)
        assert set(inside) == {1}


def test_two_threads_optimizing_at_once_leave_the_thread_count_alone(monkeypatch):
    """A starts matching; B starts after it, and finishes after A: with a process-wide set_num_threads(1)
    B would read 1 as the count to restore, and leave the process at one thread."""
    fresh, main = _in_a_new_thread(torch.get_num_threads), torch.get_num_threads()
    a_in, a_done, real = threading.Event(), threading.Event(), RMSNormPattern.match
    counts, errors = {}, []

    def spy(self, module):
        me = threading.current_thread().name
        if me == "A":
            a_in.set()
        elif me == "B":
            a_done.wait(timeout=120)
        return real(self, module)

    def run(name, started=None, done=None):
        try:
            if started is not None:
                started.wait(timeout=120)
            before = torch.get_num_threads()
            torchfuser.optimize(tiny_llama(), backend="reference")
            counts[name] = (before, torch.get_num_threads())
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
        finally:
            if done is not None:
                done.set()

    monkeypatch.setattr(RMSNormPattern, "match", spy)
    threads = [threading.Thread(target=run, name="A", args=("A", None, a_done)),
               threading.Thread(target=run, name="B", args=("B", a_in))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert counts["A"] == (fresh, fresh) and counts["B"] == (fresh, fresh)
    assert torch.get_num_threads() == main and _in_a_new_thread(torch.get_num_threads) == fresh
