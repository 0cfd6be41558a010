"""Token sampling: greedy, temperature, top-k, top-p, repetition penalty, per-request seeds."""

from __future__ import annotations

import torch

from engine.sequence import Sequence


def _apply_penalty(row: torch.Tensor, seq: Sequence, penalty: float) -> torch.Tensor:
    ids = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long, device=row.device)
    seen = row[ids]
    row = row.clone()
    row[ids] = torch.where(seen > 0, seen / penalty, seen * penalty)  # as HF's processor does
    return row


def _filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k and top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return row


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float | None]]:
    """One token per row of ``logits`` ``[N, V]`` (float32) for ``seqs``."""
    if all(s.params.greedy and s.params.repetition_penalty == 1.0 and not s.params.logprobs for s in seqs):
        return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
    tokens: list[int] = []
    logprobs: list[float | None] = []
    for row, seq in zip(logits, seqs, strict=True):
        p = seq.params
        if p.repetition_penalty != 1.0:
            row = _apply_penalty(row, seq, p.repetition_penalty)
        if p.greedy:
            tok = int(row.argmax())
            dist = row
        else:
            dist = _filter(row / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(dist, dim=-1)
            tok = int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))
        tokens.append(tok)
        logprobs.append(float(torch.log_softmax(dist, dim=-1)[tok]) if p.logprobs else None)
    return tokens, logprobs


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g
