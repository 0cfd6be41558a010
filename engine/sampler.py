"""Token sampling: greedy, temperature, top-k, top-p, repetition/frequency/presence penalties, logit
bias, per-request seeds, log-probabilities with the most likely alternatives."""

from __future__ import annotations

import math
import secrets
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
    if top_p < 1.0:  # stable: tied logits at the cut keep the same tokens on every device
        sorted_logits, order = torch.sort(row, descending=True, stable=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        drop[0] = False  # and the best one always: a top_p below float32's range (1e-300) would drop it too
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


def _draw(dists: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``dists`` ``[S, V]`` (filtered logits) by inverse transform sampling: each
    request's own CPU generator gives one uniform number, so a seed gives the same tokens on any device
    and in any batch, and only those numbers cross to the device (not a vocabulary of probabilities per
    row). Rows with no finite probability (only non-finite logits get there) take their best finite
    token rather than fail the batch."""
    probs = torch.softmax(dists, dim=-1)
    cum = probs.cumsum(dim=-1)
    total = cum[:, -1:]
    u = torch.cat([torch.rand(1, generator=g) for g in generators]).to(dists.device).unsqueeze(-1)
    ids = torch.searchsorted(cum, u * total, right=True).squeeze(-1)  # the first token whose share covers u
    # rounding can carry u * total to the total itself: then the last token that has a share
    positive = probs > 0
    last = positive.shape[-1] - 1 - positive.flip(-1).int().argmax(dim=-1)
    ids = torch.minimum(ids, last)
    ok = torch.isfinite(probs).all(dim=-1) & (total.squeeze(-1) > 0)
    return torch.where(ok, ids, _argmax(torch.nan_to_num(dists, nan=float("-inf"))))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
    """One token per row of ``logits`` ``[N, V]`` (float32) for ``seqs``. Rows are batched by kind
    (plain greedy, other greedy, sampled) so a step syncs with the device a few times, not per row."""
    plain = [s.params.greedy and not _adjusts(s) and not s.params.logprobs for s in seqs]
    tokens = _argmax(logits) if any(plain) else None  # [N] on the device
    if all(plain):
        return [Sampled(t) for t in tokens.tolist()]
    rest = [i for i, p in enumerate(plain) if not p]
    # penalties and bias first: the model's distribution as the request sees it (and reports)
    rows = {i: _adjust(logits[i], seqs[i]) if _adjusts(seqs[i]) else logits[i] for i in rest}
    greedy = [i for i in rest if seqs[i].params.greedy]
    drawn = [i for i in rest if not seqs[i].params.greedy]
    chosen = torch.zeros(len(seqs), dtype=torch.long, device=logits.device) if tokens is None else tokens
    if greedy:
        chosen[greedy] = _argmax(torch.stack([rows[i] for i in greedy]))
    if drawn:
        dists = torch.stack([_filter(rows[i] / seqs[i].params.temperature, seqs[i].params.top_k, seqs[i].params.top_p)
                             for i in drawn])
        chosen[drawn] = _draw(dists, [seqs[i].generator for i in drawn])
    out = [Sampled(t) for t in chosen.tolist()]
    want = [i for i in rest if seqs[i].params.logprobs]
    if want:
        # the model's distribution after penalties and bias, before temperature and top-k/top-p: what
        # the alternatives were, not what the filters left (those would be -inf, not JSON)
        lp = torch.log_softmax(torch.nan_to_num(torch.stack([rows[i] for i in want]), nan=float("-inf")), dim=-1)
        picked = lp.gather(1, chosen[want].unsqueeze(1)).squeeze(1).tolist()
        k = min(max(seqs[i].params.top_logprobs or 0 for i in want), lp.shape[-1])
        vals, ids = torch.topk(lp, k) if k else (lp[:, :0], lp[:, :0].long())
        vals, ids = vals.tolist(), ids.tolist()
        for n, i in enumerate(want):
            out[i].logprob = _finite(picked[n])
            if top := seqs[i].params.top_logprobs:
                out[i].top = [(t, _finite(v)) for t, v in zip(ids[n][:top], vals[n][:top], strict=True)]
    return out


def make_generator(seed: int | None) -> torch.Generator:
    """A request's own CPU generator; without a seed, a random one (``torch.seed()`` would reseed
    every device's default generator as well)."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g
