"""Token sampling: greedy, temperature, top-k, top-p, repetition/frequency/presence penalties, logit
bias, per-request seeds, log-probabilities with the most likely alternatives."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from engine.sequence import Sequence


@dataclass(slots=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


def _adjust(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    row = row.clone()
    if p.repetition_penalty != 1.0:  # every token seen, prompt included (as HF's processor does)
        ids = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long, device=row.device)
        seen = row[ids]
        row[ids] = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:  # generated tokens only (OpenAI's)
        counts = Counter(seq.output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long, device=row.device)
        n = torch.tensor(list(counts.values()), dtype=row.dtype, device=row.device)
        row[ids] -= p.frequency_penalty * n + p.presence_penalty
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
    if len(seq.output_ids) < p.min_tokens and seq.ends:  # too early to end: the ending tokens cannot win
        row[torch.tensor(seq.ends, dtype=torch.long, device=row.device)] = float("-inf")
    return row


def _adjusts(seq: Sequence) -> bool:
    return seq.params.adjusts_logits or len(seq.output_ids) < seq.params.min_tokens


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


def _finite(x: float) -> float:
    """JSON has no -inf or NaN: an impossible token's log-probability is reported as -9999 (as vLLM does)."""
    return x if math.isfinite(x) else -9999.0


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Greedy choice that a NaN logit (a broken model, a bad weight) cannot win. torch's argmax picks a
    NaN when there is one, so only then is a NaN-free copy made (not on every decode step)."""
    ids = x.argmax(dim=-1)
    if bool(torch.isnan(x.gather(-1, ids.unsqueeze(-1))).any()):
        ids = torch.nan_to_num(x, nan=float("-inf")).argmax(dim=-1)
    return ids


def _draw(dist: torch.Tensor, seq: Sequence) -> int:
    probs = torch.softmax(dist, dim=-1).cpu()
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
        # only non-finite logits get here (validated parameters keep the row finite): take the best
        # finite token rather than fail the whole batch
        return int(_argmax(dist))
    return int(torch.multinomial(probs, 1, generator=seq.generator))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """One token per row of ``logits`` ``[N, V]`` (float32) for ``seqs``."""
    if all(s.params.greedy and not _adjusts(s) and not s.params.logprobs for s in seqs):
        return [Sampled(t) for t in _argmax(logits).tolist()]
    out: list[Sampled] = []
    for row, seq in zip(logits, seqs, strict=True):
        p = seq.params
        if _adjusts(seq):
            row = _adjust(row, seq)
        if p.greedy:
            dist = row
            tok = int(_argmax(row))
        else:
            dist = _filter(row / p.temperature, p.top_k, p.top_p)
            tok = _draw(dist, seq)
        s = Sampled(tok)
        if p.logprobs:
            # the model's distribution after penalties and bias, before temperature and top-k/top-p:
            # what the alternatives were, not what the filters left (those would be -inf, not JSON)
            lp = torch.log_softmax(torch.nan_to_num(row, nan=float("-inf")), dim=-1)
            s.logprob = _finite(float(lp[tok]))
            if p.top_logprobs:
                vals, ids = torch.topk(lp, min(p.top_logprobs, lp.numel()))
                s.top = [(i, _finite(v)) for i, v in zip(ids.tolist(), vals.tolist(), strict=True)]
        out.append(s)
    return out


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g
