"""Token sampling: greedy, temperature, top-k, top-p, min-p, typical-p, repetition/frequency/presence
penalties, logit bias, per-request seeds, log-probabilities with the most likely alternatives."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from engine.guided import allowed_bits, mask_disallowed
from engine.sequence import Sequence


class NoTokenLeft(Exception):
    """A request's own constraints left its step no token to draw (the draw would be token 0, allowed or
    not): the request ends with this error, the others go on."""


@dataclass(slots=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first


@dataclass(slots=True)
class TokenCounts:
    """How often each token id occurs in a growing list of tokens (a vector as long as the logits' rows, on
    their device), and how many of them it has counted: counted once, then only the tokens added since."""
    counts: torch.Tensor
    counted: int = 0


def _tally(held: TokenCounts | None, row: torch.Tensor, since: Callable[[int], list[int]]) -> TokenCounts:
    """``held`` brought up to date with the tokens ``since(counted)`` gives (anew for another device or
    vocabulary width)."""
    if held is None or held.counts.device != row.device or held.counts.shape[0] != row.shape[-1]:
        held = TokenCounts(torch.zeros(row.shape[-1], dtype=torch.int32, device=row.device))
    if new := since(held.counted):
        idx = _to_device(torch.tensor(new, dtype=torch.long), row.device)
        held.counts.index_put_((idx,), torch.ones_like(idx, dtype=torch.int32), accumulate=True)
        held.counted += len(new)
    return held


def _context_counts(seq: Sequence, row: torch.Tensor) -> torch.Tensor:
    """The counts of ``seq``'s prompt and output so far (recounted at each token, it cost O(context))."""
    seq.context_counts = _tally(seq.context_counts, row, seq.token_range)
    return seq.context_counts.counts


def _output_counts(seq: Sequence, row: torch.Tensor) -> torch.Tensor:
    """The counts of its output alone (OpenAI's penalties)."""
    seq.output_counts = _tally(seq.output_counts, row, lambda at: seq.output_ids[at:])
    return seq.output_counts.counts


def _fixed(seq: Sequence, row: torch.Tensor) -> tuple:
    """(bias ids, bias values, allowed ids) of ``seq`` on ``row``'s device and dtype (None where unset)."""
    cached = seq.fixed_tensors
    if cached is None or cached[0] != (row.device, row.dtype):
        p = seq.params
        bias = (_to_device(torch.tensor(list(p.logit_bias), dtype=torch.long), row.device),
                _to_device(torch.tensor(list(p.logit_bias.values()), dtype=row.dtype), row.device)) \
            if p.logit_bias else (None, None)
        allowed = _to_device(torch.tensor(sorted(set(p.allowed_token_ids)), dtype=torch.long), row.device) \
            if p.allowed_token_ids else None
        seq.fixed_tensors = cached = ((row.device, row.dtype), *bias, allowed)
    return cached[1:]


def _masked(seq: Sequence) -> bool:
    """Whether ``seq``'s guide holds its next token (not while it thinks before its guided answer)."""
    return seq.matcher is not None and seq.guide_wait != "marker"


def _adjust(row: torch.Tensor, seq: Sequence, keep_raw: bool = False,
            bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The request's logits as it samples from them, in vLLM's order: its guide's mask, then
    ``logit_bias``, the penalties (so a bias is scaled by the repetition penalty, as in vLLM), the allowed
    ids, the bad words and the ending tokens held back; and (``keep_raw``) the logits under the guide's
    mask alone, whose log-probabilities the OpenAI routes report (vLLM's default, ``raw_logprobs``).
    ``bits``: its guide's allowed tokens, computed with the step's others (``allowed_bits``)."""
    # (the small index tensors go to the device pinned and asynchronous: made there from a list, each
    # was a blocking copy that waited for the step's kernels, several per row on a GPU)
    p = seq.params
    row = row.clone()
    if _masked(seq):  # only what its guide allows next
        opener = p.guide_opener if seq.guide_wait == "opener" else None
        kept = row[opener].clone() if opener is not None else None
        row = mask_disallowed(row, seq.matcher, bits)
        if kept is not None:  # (the first token may open the thinking instead)
            row[opener] = kept
    raw = row.clone() if keep_raw else None
    bias_ids, bias, allowed = _fixed(seq, row)
    if bias_ids is not None:
        row[bias_ids] += bias
    per_context = p.frequency_penalty_per_context
    if p.repetition_penalty != 1.0 or (p.frequency_penalty and per_context):
        counts = _context_counts(seq, row)
        if p.repetition_penalty != 1.0:  # every token seen, prompt included (as HF's processor does)
            penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            big = torch.finfo(row.dtype).max  # (a penalty near 0 or past 1e38 overflows: inf, then NaN)
            # (an impossible token, -inf under its guide's mask, stays impossible: clamped, it was a
            # finite -3.4e38 that the checks for "no token left" took for a token)
            row = torch.where((counts > 0) & torch.isfinite(row), penalized.clamp(-big, big), row)
        if p.frequency_penalty and per_context:  # TGI's: the whole context's counts over its length
            row -= p.frequency_penalty * counts.to(row.dtype) / seq.num_tokens
    frequency = 0.0 if per_context else p.frequency_penalty
    if (frequency or p.presence_penalty) and seq.output_ids:  # generated tokens only (OpenAI's)
        n = _output_counts(seq, row).to(row.dtype)
        row -= frequency * n + p.presence_penalty * (n > 0).to(row.dtype)
    if allowed is not None:  # everything else becomes impossible
        row = torch.full_like(row, float("-inf")).index_copy_(0, allowed, row[allowed])
    if banned := _bad_word_ends(seq):
        ids = _to_device(torch.tensor(banned, dtype=torch.long), row.device)
        before = row[ids].clone()
        row[ids] = float("-inf")
        if seq.matcher is not None and not torch.isfinite(row).any():  # the guide allows nothing else:
            row[ids] = before  # the structure wins (with no token left, the draw would be token 0)
    # too early to end (min_tokens), or still thinking before a guided answer: the ending tokens cannot win
    if seq.ends and (len(seq.output_ids) < p.min_tokens or seq.guide_wait == "marker"):
        row[_to_device(torch.tensor(seq.ends, dtype=torch.long), row.device)] = float("-inf")
    return row, raw


def _bad_word_ends(seq: Sequence) -> list[int]:
    """The tokens that would complete one of the request's bad words now: a word's last token, where the
    generated tokens end with the rest of it (a one-token word: always)."""
    out = seq.output_ids
    return [w[-1] for w in seq.params.bad_words_ids
            if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])]


def _adjusts(seq: Sequence) -> bool:
    return seq.params.adjusts_logits or len(seq.output_ids) < seq.params.min_tokens


# top-p looks for its cut among this many best tokens first (more only when they hold less than top_p):
# a full sort of every row's vocabulary cost ~3 ms per 32k-token row on a CPU, the sampler's whole time
TOP_P_CANDIDATES = 256


def _filter(dists: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float] | None = None,
            typical_p: list[float] | None = None) -> torch.Tensor:
    """Min-p, top-k, top-p (vLLM's order: top-p is measured among what min-p left), then typical-p over the
    rows of ``dists`` ``[S, V]`` (logits over temperature), each row with its own values. Each cuts at a
    value, so tokens tied with the last one kept stay too (the same set on every device, whatever order a
    sort gives ties)."""
    v = dists.shape[-1]
    if min_p and any(m > 0 for m in min_p):
        # p < min_p x p_max is logit < max logit + log(min_p): no softmax, no sort (log 0 = -inf cuts nothing)
        floor = torch.log(_to_device(torch.tensor(min_p, dtype=dists.dtype), dists.device)).unsqueeze(1)
        dists = dists.masked_fill(dists < dists.max(dim=-1, keepdim=True).values + floor, float("-inf"))
    if any(0 < k < v for k in top_k):
        vals = torch.topk(dists, max(k for k in top_k if 0 < k < v)).values  # (a k past the vocabulary cuts nothing)
        # (a row whose k cuts nothing reads column 0: vals has only as many columns as the largest real k)
        at = _to_device(torch.tensor([k - 1 if 0 < k < v else 0 for k in top_k]), dists.device).unsqueeze(1)
        kth = vals.gather(1, at)
        off = _to_device(torch.tensor([not 0 < k < v for k in top_k]), dists.device).unsqueeze(1)
        dists = dists.masked_fill((dists < kth) & ~off, float("-inf"))
    if any(p < 1.0 for p in top_p):
        dists = _nucleus(dists, top_p)
    if typical_p and any(t < 1.0 for t in typical_p):
        dists = _typical(dists, typical_p)
    return dists


def _typical(dists: torch.Tensor, typical_p: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022): keep the tokens whose surprisal is closest to the
    distribution's entropy, most typical first, until they hold ``typical_p`` of the probability (the
    one that crosses it included, and at least one). Only the rows that ask for it pay for the sort."""
    rows = [i for i, t in enumerate(typical_p) if t < 1.0]
    idx = _to_device(torch.tensor(rows), dists.device)
    sub = dists[idx]
    logp = torch.log_softmax(sub, dim=-1)
    probs = logp.exp()
    entropy = -(logp * probs).nansum(dim=-1, keepdim=True)  # (-inf x 0 is NaN: an impossible token adds nothing)
    distance = (-logp - entropy).abs()  # +inf for impossible tokens: sorted last, never kept
    order_vals, order = torch.sort(distance, dim=-1)
    cum = probs.gather(1, order).cumsum(dim=-1)
    mass = _to_device(torch.tensor([typical_p[i] for i in rows], dtype=cum.dtype), dists.device).unsqueeze(1)
    last = (cum < mass).sum(dim=-1, keepdim=True).clamp(max=sub.shape[-1] - 1)
    cut = order_vals.gather(1, last)
    sub = sub.masked_fill(distance > cut, float("-inf"))
    out = dists.clone()
    out[idx] = sub
    return out


def _nucleus(dists: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep each row's best tokens up to the one whose probability crosses its ``top_p`` (the best one
    always: a top_p below float32's range would drop it too). The cut is looked for among each row's
    best ``TOP_P_CANDIDATES`` tokens; only the rows whose candidates hold less than their top_p (a flat
    distribution) look again among eight times as many, so one flat row does not widen the batch. One
    sync with the device per pass."""
    v = dists.shape[-1]
    # compared in the logits' dtype: a top_p of 0.99999999 is 1.0 there, and cuts nothing
    p_host = torch.tensor(top_p, dtype=dists.dtype).unsqueeze(1)
    cut = p_host[:, 0] < 1.0
    if not bool(cut.any()):  # (on the host: no sync)
        return dists
    p = _to_device(p_host, dists.device)
    rows = None if bool(cut.all()) else _to_device(cut.nonzero().squeeze(1), dists.device)  # None: every row
    lse = torch.logsumexp(dists, dim=-1, keepdim=True)
    threshold = torch.full_like(lse, float("-inf"))
    k = min(TOP_P_CANDIDATES, v)
    while True:
        sub, sub_p, sub_lse = (dists, p, lse) if rows is None else (dists[rows], p[rows], lse[rows])
        vals = torch.topk(sub, k).values  # best first
        probs = torch.exp(vals - sub_lse)
        cum = probs.cumsum(dim=-1)
        drop = cum - probs >= sub_p  # from the token after the one that crosses top_p
        drop[:, 0] = False
        kept = (~drop).sum(dim=-1, keepdim=True)
        # (a row not found yet is written again on a later pass; at k == v every row is found)
        found = (cum[:, -1:] >= sub_p) | (k == v)
        if rows is None:
            threshold = vals.gather(1, kept - 1)
        else:
            threshold[rows] = vals.gather(1, kept - 1)
        left = (~found[:, 0]).nonzero().squeeze(1)  # the pass's one sync
        if not left.numel():
            break
        rows, k = (left if rows is None else rows[left]), min(v, k * 8)
    return dists.masked_fill(dists < threshold, float("-inf"))


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for it (pinned, asynchronous) on CUDA."""
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def finite_logprob(x: float) -> float:
    """JSON has no -inf or NaN: an impossible token's log-probability is reported as -9999 (as vLLM does),
    and so is any below it (a possible token must not rank under an impossible one)."""
    return x if x >= -9999.0 else -9999.0  # (NaN compares False: -9999 too)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Greedy choice that a NaN logit (a broken model, a bad weight) cannot win. torch's argmax picks a
    NaN when there is one, so only then is a NaN-free copy made (not on every decode step)."""
    ids = x.argmax(dim=-1)
    if bool(torch.isnan(x.gather(-1, ids.unsqueeze(-1))).any()):
        ids = torch.nan_to_num(x, nan=float("-inf")).argmax(dim=-1)
    return ids


def _draw(dists: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of ``dists`` ``[S, V]`` (filtered logits) by inverse transform sampling: each
    request's own CPU generator gives one uniform number, so a request's draws do not depend on the rest
    of its batch, and only those numbers cross to the device (not a vocabulary of probabilities per
    row). Rows with no finite probability (only non-finite logits get there) take their best finite
    token rather than fail the batch."""
    probs = torch.softmax(dists, dim=-1)
    # in float64: a float32 running sum over a large vocabulary stops moving for the smallest tokens,
    # which could then never be drawn
    cum = probs.double().cumsum(dim=-1)
    total = cum[:, -1:]
    u = _to_device(torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]), dists.device).unsqueeze(-1)
    ids = torch.searchsorted(cum, u * total, right=True).squeeze(-1)  # the first token whose share covers u
    # rounding can carry u * total to the total itself: then the last token that has a share
    positive = probs > 0
    last = positive.shape[-1] - 1 - positive.flip(-1).int().argmax(dim=-1)
    ids = torch.minimum(ids, last)
    ok = torch.isfinite(probs).all(dim=-1) & (total.squeeze(-1) > 0)
    # (the copy has no NaN: its plain argmax, without _argmax's check, a sync with the device each step)
    return torch.where(ok, ids, torch.nan_to_num(dists, nan=float("-inf")).argmax(dim=-1))


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled | NoTokenLeft]:
    """One token per row of ``logits`` ``[N, V]`` (float32) for ``seqs``. Rows are batched by kind
    (plain greedy, other greedy, sampled) so a step syncs with the device a few times, not per row. A row
    whose request's adjustments leave no token possible gets a ``NoTokenLeft`` instead."""
    if not seqs:
        return []
    plain = [s.params.greedy and not _adjusts(s) and not s.params.logprobs for s in seqs]
    tokens = _argmax(logits) if any(plain) else None  # [N] on the device
    if all(plain):
        return [Sampled(t) for t in tokens.tolist()]
    rest = [i for i, p in enumerate(plain) if not p]
    # penalties and bias first: the model's distribution as the request samples from it; and, for the
    # log-probabilities, the model's own (under a guide's mask)
    rows, raws = {}, {}
    guided = [i for i in rest if _masked(seqs[i])]
    bits = dict(zip(guided, allowed_bits([seqs[i].matcher for i in guided], logits.shape[-1],
                                         pinned=logits.device.type == "cuda"), strict=True)) if guided else {}
    for i in rest:
        if _adjusts(seqs[i]):
            rows[i], raws[i] = _adjust(logits[i], seqs[i], keep_raw=bool(seqs[i].params.logprobs), bits=bits.get(i))
        else:
            rows[i] = raws[i] = logits[i]
    greedy = [i for i in rest if seqs[i].params.greedy]
    drawn = [i for i in rest if not seqs[i].params.greedy]
    chosen = torch.zeros(len(seqs), dtype=torch.long, device=logits.device) if tokens is None else tokens
    if greedy:
        chosen[greedy] = _argmax(torch.stack([rows[i] for i in greedy]))
    if drawn:
        # (a temperature past the dtype's range would be inf, and the row NaN: greedy, not uniform)
        top = torch.finfo(logits.dtype).max
        temps = _to_device(torch.tensor([min(seqs[i].params.temperature, top) for i in drawn], dtype=logits.dtype),
                           logits.device)
        dists = _filter(torch.stack([rows[i] for i in drawn]) / temps.unsqueeze(1),
                        [seqs[i].params.top_k for i in drawn], [seqs[i].params.top_p for i in drawn],
                        [seqs[i].params.min_p for i in drawn], [seqs[i].params.typical_p for i in drawn])
        chosen[drawn] = _draw(dists, [seqs[i].generator for i in drawn])
    adjusted = [i for i in rest if _adjusts(seqs[i])]
    if adjusted:  # (brought over with the tokens: no sync of its own)
        none_left = (torch.stack([rows[i] for i in adjusted]) == float("-inf")).all(dim=-1)
        host = torch.cat([chosen, none_left.long()]).tolist()
    else:
        host = chosen.tolist()
    out: list = [Sampled(t) for t in host[:len(seqs)]]
    want = [i for i in rest if seqs[i].params.logprobs]
    if want:
        # the model's own distribution (under a guide's mask), as vLLM reports by default: what the
        # alternatives were, before bias, penalties and filters; or, asked for (TGI's), the one the
        # token was drawn from, after them and temperature (a greedy token's: after bias and penalties)
        drawn_row = {i: n for n, i in enumerate(drawn)}
        processed = {i for i in want if seqs[i].params.processed_logprobs}
        stacked = torch.stack([(dists[drawn_row[i]] if i in drawn_row else rows[i]) if i in processed else raws[i]
                               for i in want])
        # (NaN as impossible; -inf stays -inf, reported as -9999)
        lp = torch.log_softmax(stacked.masked_fill(stacked.isnan(), float("-inf")), dim=-1)
        picked = lp.gather(1, chosen[want].unsqueeze(1)).squeeze(1).tolist()
        best = top_alternatives(lp, max(seqs[i].params.top_logprobs or 0 for i in want))
        for n, i in enumerate(want):
            out[i].logprob = finite_logprob(picked[n])
            if top := seqs[i].params.top_logprobs:
                out[i].top = best[n][:top]
    for i, empty in zip(adjusted, host[len(seqs):], strict=True):
        if empty:
            out[i] = NoTokenLeft(
                f"no token is left to generate at output token {len(seqs[i].output_ids) + 1}: the request's "
                "allowed_token_ids and bad_words, with the ending tokens held back before min_tokens (or before "
                "a guided answer), exclude every token")
    return out


def top_alternatives(lp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row of log-probabilities ``lp`` ``[N, V]``: its ``k`` likeliest (token id, log-probability),
    best first, -inf reported as -9999."""
    k = min(k, lp.shape[-1])
    if not k:
        return [[] for _ in range(lp.shape[0])]
    vals, ids = torch.topk(lp, k)
    return [[(t, finite_logprob(v)) for t, v in zip(ti, tv, strict=True)]
            for ti, tv in zip(ids.tolist(), vals.tolist(), strict=True)]


def make_generator(seed: int | None) -> torch.Generator:
    """A request's own CPU generator; without a seed, a random one (``torch.seed()`` would reseed
    every device's default generator as well)."""
    g = torch.Generator()
    g.manual_seed(generator_seed(seed if seed is not None else secrets.randbits(63)))
    return g


def generator_seed(seed: int) -> int:
    """What a request's seed (-2**63 to 2**64, as unsigned) seeds its generator with: a CPU generator
    keeps only 32 bits, so 5 and 5 + 2**32 drew the same tokens; a seed past 32 bits goes through a hash
    instead (the 2**32 streams stay, but no longer in pairs a user would pick)."""
    s = seed & 0xFFFF_FFFF_FFFF_FFFF
    return s if s <= 0xFFFF_FFFF else xxhash.xxh3_64_intdigest(s.to_bytes(8, "little")) & 0xFFFF_FFFF
