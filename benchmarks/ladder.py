"""Longer and longer rows on one trained model, for context_length.py (``train_step.py --ladder``): one
timed step a length, going up until out of memory or until the next step would overrun a time budget.

One process keeps the model for every length (an 8B QLoRA model takes a minute to build and quantise); an
out-of-memory step frees what it held and ends the ladder, so a fragmented cache could end it one length early
against a fresh process (context_length.py runs with expandable segments, which avoid most of that).
"""
from __future__ import annotations

import gc
import time

import torch

import workloads


def one_step(step_fn, opt, inputs: dict, autocast) -> float:
    """Forward, backward and the optimiser step on one batch; the loss."""
    with autocast:
        loss = step_fn(**inputs, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def climb(step_fn, opt, vocab: int, args, device, autocast, sync, first_s: float) -> dict:
    """One timed step at each of ``args.ladder``'s lengths (ascending) on the model ``step_fn`` trains: a
    point per length (ms, tokens/s, peak GiB), then one with the status that ended the climb: ``oom``, or
    ``budget`` when a step would take the run past ``args.ladder_budget`` seconds (the next step's time
    projected from the last one's as growing with the square of the length: attention's share, an
    overestimate). ``first_s``: the last step's seconds at ``args.seq``, where the climb starts from.
    Returns the points and the device's memory (``total_gib``), against which context_length.py fits them."""
    points, began, last = [], time.perf_counter(), (args.seq, first_s)
    for seq in args.ladder:
        projected = last[1] * (seq / last[0]) ** 2
        if args.ladder_budget and time.perf_counter() - began + projected > args.ladder_budget:
            points.append({"seq": seq, "status": "budget", "projected_s": round(projected, 1)})
            break
        inputs = {k: v for k, v in workloads.batches(args.workload, 1, vocab, args.batch, seq, args.seed, device)[0].items()
                  if k != "tokens"}
        cuda = device.type == "cuda"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            sync()
            start = time.perf_counter()
            loss = one_step(step_fn, opt, inputs, autocast)
            sync()
        except torch.cuda.OutOfMemoryError as err:
            opt.zero_grad(set_to_none=True)
            del inputs
            gc.collect()
            torch.cuda.empty_cache()
            points.append({"seq": seq, "status": "oom", "why": str(err).splitlines()[0][:200]})
            break
        seconds = time.perf_counter() - start
        last = (seq, seconds)
        points.append({"seq": seq, "status": "ok", "ms_per_step": round(seconds * 1e3, 1),
                       "tokens_per_s": round(args.batch * seq / seconds),
                       "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
                       "loss": round(loss, 4)})
        print(f"ladder {seq}: {points[-1]}", flush=True)
    total = torch.cuda.mem_get_info(device)[1] / 2**30 if device.type == "cuda" else None
    return {"points": points, "total_gib": None if total is None else round(total, 2)}
