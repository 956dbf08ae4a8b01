"""The batches a training-step benchmark feeds a model, one workload each (benchmarks/train_step.py
``--workload``), all from fixed seeds so every variant trains on the same tokens:

- ``fixed``: ``batch`` rows of ``seq`` random tokens, no mask (the default).
- ``varying``: padded SFT batches whose length changes every step: a length L drawn between
  ``seq // 2`` and ``seq`` (1024-2048 at the default 2048), ``batch`` rows each right-padded by up to
  L/4 tokens, the attention mask 0 and the labels -100 on the padding.
- ``packed``: padding-free rows as transformers' ``DataCollatorWithFlattening`` builds them: samples
  with SFT-like lengths (log-normal, mean about 300, a long tail cut at ``seq``) concatenated into
  rows of ``pack`` tokens (8192), ``position_ids`` restarting at each sample, the label of each
  sample's first token -100, no attention mask.
- ``padded-samples``: the very samples of ``packed``, in the same order, as padded batches: each
  batch takes samples while (samples × the longest) stays within the packed rows' tokens.

Each batch is a dict of model keyword arguments plus ``tokens``: the real (non-padding) tokens in it,
which is what tokens/s counts.
"""
from __future__ import annotations

import math

import torch

WORKLOADS = ("fixed", "varying", "packed", "padded-samples")
PACK = 8192
_MEAN_SAMPLE = 300


def batches(workload: str, n: int, vocab: int, batch: int, seq: int, seed: int, device) -> list[dict]:
    """``n`` batches of ``workload`` (see the module doc)."""
    gen = torch.Generator().manual_seed(seed + 1)
    if workload == "fixed":
        out = [_plain(torch.randint(0, vocab, (batch, seq), generator=gen)) for _ in range(n)]
    elif workload == "varying":
        out = [_varying(gen, vocab, batch, seq) for _ in range(n)]
    elif workload in ("packed", "padded-samples"):
        rows = [_pack(s) for s in _packed_samples(gen, vocab, n * batch, seq)]
        if workload == "packed":
            out = [_stack_packed(rows[i * batch:(i + 1) * batch]) for i in range(n)]
        else:
            samples = [s for row in rows for s in row[0]]
            out = _padded(samples, budget=batch * PACK)
    else:
        raise ValueError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")
    return [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in out]


def _plain(ids):
    return {"input_ids": ids, "labels": ids, "tokens": ids.numel()}


def _varying(gen, vocab, batch, seq):
    length = int(torch.randint(seq // 2, seq + 1, (1,), generator=gen))
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    real = length - torch.randint(0, length // 4 + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < real[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
            "tokens": int(mask.sum())}


def _sample_lengths(gen, count, longest):
    """Log-normal lengths, mean ≈ 300 tokens, σ = 1 (a long tail), cut to [16, longest]."""
    sigma = 1.0
    mu = math.log(_MEAN_SAMPLE) - sigma ** 2 / 2
    z = torch.randn(count, generator=gen, dtype=torch.float64)
    return (mu + sigma * z).exp().round().clamp(16, longest).long().tolist()


def _packed_samples(gen, vocab, rows, longest):
    """``rows`` rows of samples, each row's lengths summing to at most PACK (the last sample cut to fit)."""
    out = []
    for _ in range(rows):
        row, room = [], PACK
        while room > 0:
            length = min(_sample_lengths(gen, 1, longest)[0], room)
            row.append(torch.randint(0, vocab, (length,), generator=gen))
            room -= length
        out.append(row)
    return out


def _pack(samples):
    ids = torch.cat(samples)
    pos = torch.cat([torch.arange(len(s)) for s in samples])
    labels = ids.clone()
    labels[pos == 0] = -100  # as DataCollatorWithFlattening: no sample predicts the previous one's last token
    return samples, ids, pos, labels


def _stack_packed(rows):
    ids = torch.stack([r[1] for r in rows])
    return {"input_ids": ids, "position_ids": torch.stack([r[2] for r in rows]),
            "labels": torch.stack([r[3] for r in rows]), "tokens": ids.numel()}


def _padded(samples, budget):
    out, group = [], []

    def flush():
        longest = max(len(s) for s in group)
        ids = torch.zeros(len(group), longest, dtype=torch.long)
        mask = torch.zeros(len(group), longest, dtype=torch.long)
        for i, s in enumerate(group):
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
        # Each sample's first token is predicted by nothing, as in the packed rows (there: its -100).
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "tokens": int(mask.sum())})

    for s in samples:
        if group and (len(group) + 1) * max(len(s), *(len(g) for g in group)) > budget:
            flush()
            group = []
        group.append(s)
    if group:
        flush()
    return out


def add_lora(model, r: int, seed: int):
    """PEFT LoRA adapters of rank ``r`` (alpha 2r, no dropout) on every projection of the attention and
    MLP blocks (q, k, v, o, gate, up, down; the output layer excluded), the same in every variant."""
    import peft

    torch.manual_seed(seed + 2)
    return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear",
                                                      lora_dropout=0.0))
