"""The sampler on crafted logits (penalties, bias, top log-probs, degenerate rows) and in the engine
(a temperature too small to divide by must not take the engine down)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.llm_engine import RequestError
from engine.sampler import make_generator, sample
from engine.sequence import SamplingError, SamplingParams, Sequence

PROMPT = list(range(40, 110))


def seq(output: list[int] | None = None, **kw) -> Sequence:
    s = Sequence("r", [1, 2, 3], SamplingParams(**kw))
    s.output_ids = list(output or [])
    if not s.params.greedy:
        s.generator = make_generator(0)
    return s


def row(best: int = 5, margin: float = 1.0, vocab: int = 10) -> torch.Tensor:
    r = torch.zeros(1, vocab)
    r[0, best] = margin
    return r


def test_frequency_and_presence_penalties_count_generated_tokens():
    # token 5 leads by 1.0; generated twice, a frequency penalty of 0.6 costs it 1.2 and it loses
    assert sample(row(), [seq([5, 5], frequency_penalty=0.6)])[0].token != 5
    assert sample(row(), [seq([5], frequency_penalty=0.6)])[0].token == 5  # once: 0.6 < 1.0
    assert sample(row(), [seq([5], presence_penalty=1.5)])[0].token != 5
    assert sample(row(), [seq([5], presence_penalty=-1.5)])[0].token == 5
    # the prompt's tokens are not penalized (OpenAI's penalties look at the output only)
    assert sample(row(best=2), [seq([], frequency_penalty=2.0)])[0].token == 2


def test_logit_bias_moves_a_token():
    assert sample(row(), [seq(logit_bias={7: 100.0})])[0].token == 7
    assert sample(row(), [seq(logit_bias={5: -100.0})])[0].token != 5


def test_top_logprobs_are_the_best_alternatives():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]])
    out = sample(logits, [seq(logprobs=True, top_logprobs=3)])[0]
    lp = torch.log_softmax(logits[0], -1)
    assert out.token == 1 and out.logprob == pytest.approx(float(lp[1]))
    assert [t for t, _ in out.top] == [1, 3, 2]
    assert [v for _, v in out.top] == pytest.approx([float(lp[1]), float(lp[3]), float(lp[2])])
    assert sample(logits, [seq(logprobs=True)])[0].top is None


def test_logprobs_stay_finite_and_unfiltered_under_top_k_and_nan():
    # top-k leaves -inf for the other tokens: JSON cannot carry it, and the alternatives are the model's
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0, 0.5]])
    out = sample(logits, [seq(temperature=0.8, top_k=2, logprobs=True, top_logprobs=5)])[0]
    lp = torch.log_softmax(logits[0], -1)
    assert out.token in (1, 3) and out.logprob == pytest.approx(float(lp[out.token]))
    assert [t for t, _ in out.top] == [1, 3, 2, 5, 0]
    assert all(math.isfinite(v) for _, v in out.top)
    nan_row = torch.full((1, 4), float("nan"))
    nan_row[0, 2] = 0.0
    out = sample(nan_row, [seq(logprobs=True, top_logprobs=3)])[0]
    assert out.token == 2 and math.isfinite(out.logprob) and all(math.isfinite(v) for _, v in out.top)
    # an impossible token (a -inf logit) is reported as -9999, not as float32's lowest number
    out = sample(torch.tensor([[0.0, float("-inf"), 1.0]]), [seq(logprobs=True, top_logprobs=3)])[0]
    assert out.top[-1] == (1, -9999.0)
    assert sample(torch.zeros(0, 5), []) == []


def test_tiny_temperatures_sample_greedily_and_bad_rows_do_not_raise():
    logits = torch.randn(1, 50)
    best = int(logits.argmax())
    for t in (1e-300, 1e-6):
        assert sample(logits, [seq(temperature=t)])[0].token == best
        assert sample(logits, [seq(temperature=1.0, top_p=t)])[0].token == best  # 1e-300 is 0 in float32
    nan_row = torch.full((1, 10), float("nan"))
    nan_row[0, 4] = 1.0
    assert sample(nan_row, [seq(temperature=0.7, logprobs=True)])[0].token == 4
    assert sample(nan_row, [seq()])[0].token == 4


@pytest.mark.parametrize("kw", [dict(temperature=math.inf), dict(temperature=math.nan),
                                dict(repetition_penalty=math.inf), dict(frequency_penalty=2.5),
                                dict(presence_penalty=-3.0), dict(logit_bias={1: 101.0}), dict(top_logprobs=21)])
def test_out_of_range_parameters_are_refused(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw).validate()


def test_engine_survives_a_tiny_temperature_and_checks_bias_ids(make_engine):
    eng = make_engine("tiny")
    greedy = eng.generate([PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].output_ids
    tiny = eng.generate([PROMPT], SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1e-300))[0]
    assert tiny.output_ids == greedy
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request(PROMPT, SamplingParams(logit_bias={eng.vocab_size: 1.0}))


def test_draws_follow_the_distribution_and_its_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0, 0.5]])
    probs = torch.softmax(logits[0], -1).tolist()
    s, n = seq(temperature=1.0), 4000
    counts = Counter(sample(logits, [s])[0].token for _ in range(n))
    for t, p in enumerate(probs):  # within 4 standard deviations of the expected count
        assert abs(counts[t] - n * p) <= 4 * math.sqrt(n * p * (1 - p)) + 1, (t, counts[t], n * p)
    # top-p 0.7 keeps the two best (0.56 + 0.21 crosses it), top-k 3 the three best: nothing else comes
    nucleus, top3 = seq(temperature=1.0, top_p=0.7), seq(temperature=1.0, top_k=3)
    assert {sample(logits, [nucleus])[0].token for _ in range(400)} == {0, 1}
    assert {sample(logits, [top3])[0].token for _ in range(400)} == {0, 1, 5}


def test_a_seeded_request_draws_the_same_tokens_alone_and_in_any_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    alone, batched = seq(temperature=0.9, top_p=0.95), seq(temperature=0.9, top_p=0.95)  # both seed 0
    neighbours = [seq(), seq(logprobs=True, top_logprobs=2), seq(temperature=1.3, frequency_penalty=0.5)]
    a = [sample(logits[1:2], [alone])[0].token for _ in range(30)]
    b = [sample(logits, [neighbours[0], batched, *neighbours[1:]])[1].token for _ in range(30)]
    assert a == b and len(set(a)) > 3
    out = sample(logits, [neighbours[0], batched, *neighbours[1:]])  # and each neighbour gets its own kind
    assert out[0].token == int(logits[0].argmax()) and out[0].logprob is None
    assert out[2].token == int(logits[2].argmax()) and len(out[2].top) == 2 and out[2].top[0][0] == out[2].token


def _reference_top_p(row: torch.Tensor, top_p: float) -> set[int]:
    """Top-p by a full sort, token by token: the best tokens up to the one that crosses top_p, and any
    tied with it."""
    probs = torch.softmax(row.double(), -1)
    kept, mass = [], 0.0
    for i in torch.argsort(row, descending=True, stable=True).tolist():
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i])
    return set(torch.nonzero(row >= row[kept[-1]]).flatten().tolist())


@pytest.mark.parametrize("vocab", [50, 300, 5000])
def test_top_p_over_its_best_candidates_keeps_what_a_full_sort_keeps(vocab):
    from engine.sampler import TOP_P_CANDIDATES, _filter

    assert TOP_P_CANDIDATES < 5000  # the flat rows below need more than the first candidates
    g = torch.Generator().manual_seed(vocab)
    rows = torch.cat([torch.randn(4, vocab, generator=g) * 3,  # peaked
                      torch.randn(4, vocab, generator=g) * 0.01,  # nearly flat: the cut lies far down
                      torch.randint(0, 4, (2, vocab), generator=g).float()])  # ties everywhere
    for top_p in (1e-9, 0.3, 0.9, 0.999):
        out = _filter(rows, [0] * len(rows), [top_p] * len(rows))
        for row, filtered in zip(rows, out, strict=True):
            assert set(torch.nonzero(filtered > float("-inf")).flatten().tolist()) == _reference_top_p(row, top_p)
    # a top_p that float32 rounds to 1.0 cuts nothing (it once looked through the whole vocabulary for
    # a cut, and its float32 sums dropped the tail)
    assert torch.equal(_filter(rows, [0] * len(rows), [0.99999999] * len(rows)), rows)
    out = _filter(rows[:2], [0, 0], [0.99999999, 0.3])
    assert torch.equal(out[0], rows[0]) and set(torch.nonzero(out[1] > float("-inf")).flatten().tolist()) == \
        _reference_top_p(rows[1], 0.3)
    # rows with their own values in one call, top-k first (a top-k past the vocabulary cuts nothing)
    assert torch.equal(_filter(rows[:2], [vocab + 1, 0], [1.0, 1.0]), rows[:2])
    out = _filter(rows[:3], [0, 5, 0], [0.9, 1.0, 1.0])
    assert set(torch.nonzero(out[0] > float("-inf")).flatten().tolist()) == _reference_top_p(rows[0], 0.9)
    assert int((out[1] > float("-inf")).sum()) == min(5, vocab) and torch.equal(out[2], rows[2])


def test_a_top_k_past_the_vocabulary_beside_a_small_one_cuts_nothing_and_does_not_fail():
    # vals held only the largest real k's columns; a row whose k was past the vocabulary read column
    # V - 1 of it (an index error on the CPU, a device-side assert that loses the replica on CUDA)
    from engine.sampler import _filter

    torch.manual_seed(0)
    dists = torch.randn(3, 320)
    out = _filter(dists, [5, 1000, 320], [1.0, 1.0, 1.0])
    assert torch.isfinite(out[0]).sum() == 5
    assert torch.equal(out[1], dists[1]) and torch.equal(out[2], dists[2])


# ----------------------------------------------------------------------------- TGI's penalties
def _tgi_reference(context: list[int], logits: torch.Tensor, repetition: float,
                   frequency: float) -> torch.Tensor:
    """TGI's documented semantics, written out token by token for one request: first the repetition
    penalty on every token of ``context`` (prompt and generated so far: positive logits divided by it,
    negative ones multiplied), then each token loses ``frequency`` x its count in ``context`` / its length."""
    out = logits.clone()[0]
    for t in set(context):
        x = float(out[t])
        out[t] = x / repetition if x > 0 else x * repetition
    for t in set(context):
        out[t] -= frequency * context.count(t) / len(context)
    return out.unsqueeze(0)


def _tgi_seq(prompt: list[int], output: list[int], **kw) -> Sequence:
    from app.schemas import TGIRequest

    params = TGIRequest.model_validate({"inputs": "x", "parameters": kw}).sampling(64)
    s = Sequence("r", prompt, SamplingParams(**params).validate())
    s.output_ids = list(output)
    if not s.params.greedy:
        s.generator = make_generator(s.params.seed)
    return s


def _reported(logits: torch.Tensor, seqs: list[Sequence]) -> list[torch.Tensor]:
    """The log-probabilities each row reports (the model's; for TGI's rows the distribution drawn from:
    after the penalties, the temperature and the filters)."""
    for s in seqs:
        s.params.logprobs, s.params.top_logprobs = True, 20
    out = sample(logits, seqs)
    vocab = logits.shape[-1]
    return [torch.tensor([dict(o.top)[t] for t in range(vocab)]) for o in out]


@pytest.mark.parametrize("repetition", [1.0, 1.3, 0.8])
def test_tgi_frequency_penalty_is_tgis_count_over_the_context_length(repetition):
    # TGI's frequency penalty counts prompt and generated tokens and divides by the context's length:
    # token 5 (twice in 7 tokens) loses 1.0 x 2/7, not OpenAI's 1.0 x 2
    torch.manual_seed(0)
    logits = torch.randn(1, 12)
    prompt, output = [1, 5, 2, 3, 1], [5, 9]
    s = _tgi_seq(prompt, output, frequency_penalty=1.0, repetition_penalty=repetition)
    want = torch.log_softmax(_tgi_reference(prompt + output, logits, repetition, 1.0), -1)[0]
    assert torch.allclose(_reported(logits, [s])[0], want, atol=1e-5)
    # before anything is generated the prompt alone is the context (TGI's first token)
    s = _tgi_seq(prompt, [], frequency_penalty=-2.0, repetition_penalty=repetition)
    want = torch.log_softmax(_tgi_reference(prompt, logits, repetition, -2.0), -1)[0]
    assert torch.allclose(_reported(logits, [s])[0], want, atol=1e-5)


def test_tgi_frequency_penalty_barely_moves_a_leading_token():
    # token 5 leads by 1.0 and was generated twice after a 3-token prompt: OpenAI's 2.0 x 2 sinks it,
    # TGI's 2.0 x 2/5 = 0.8 does not
    assert sample(row(), [seq([5, 5], frequency_penalty=2.0)])[0].token != 5
    s = Sequence("r", [1, 2, 3], SamplingParams(frequency_penalty=2.0, frequency_penalty_per_context=True))
    s.output_ids = [5, 5]
    assert sample(row(), [s])[0].token == 5


def test_a_batch_mixes_tgi_and_openai_frequency_penalties():
    torch.manual_seed(1)
    logits = torch.randn(3, 12)
    prompt, output = [1, 5, 2, 3, 1], [5, 9, 5]
    tgi = _tgi_seq(prompt, output, frequency_penalty=1.5, temperature=0.7, seed=3)
    openai = Sequence("o", prompt, SamplingParams(frequency_penalty=1.5, presence_penalty=0.5,
                                                  temperature=0.7, seed=3))
    openai.output_ids, openai.generator = list(output), make_generator(3)
    greedy = Sequence("g", prompt, SamplingParams())
    greedy.output_ids = list(output)
    got = _reported(logits, [openai, tgi, greedy])
    # OpenAI's routes report the model's own distribution (vLLM's default, raw_logprobs), not the penalized one
    assert torch.allclose(got[0], torch.log_softmax(logits[0], -1), atol=1e-5)
    # (TGI's: of the distribution it drew from, penalties first, then the temperature)
    want = torch.log_softmax(_tgi_reference(prompt + output, logits[1:2], 1.0, 1.5) / 0.7, -1)[0]
    assert torch.allclose(got[1], want, atol=1e-5)
    assert torch.allclose(got[2], torch.log_softmax(logits[2], -1), atol=1e-5)


def test_tgi_reports_the_log_probabilities_of_the_distribution_it_drew_from():
    # TGI (HeterogeneousNextTokenChooser) takes log_softmax after its warpers: temperature, then top-k;
    # OpenAI's and vLLM's are the model's, the same request's through the other API
    torch.manual_seed(2)
    logits = torch.randn(1, 12)
    tgi = _tgi_seq([1, 2, 3], [], temperature=0.5, top_k=3, seed=4)
    tgi.params.logprobs, tgi.params.top_logprobs = True, 5
    out = sample(logits, [tgi])[0]
    warped = logits[0] / 0.5
    kept = set(torch.topk(warped, 3).indices.tolist())
    warped[[t for t in range(12) if t not in kept]] = float("-inf")
    want = torch.log_softmax(warped, -1)
    assert out.token in kept and out.logprob == pytest.approx(float(want[out.token]), abs=1e-5)
    assert {t for t, _ in out.top[:3]} == kept and [v for _, v in out.top[3:]] == [-9999.0, -9999.0]
    assert sum(math.exp(v) for _, v in out.top[:3]) == pytest.approx(1.0, abs=1e-5)
    openai = seq(temperature=0.5, top_k=3, seed=4, logprobs=True)
    raw = sample(logits, [openai])[0]
    assert raw.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[raw.token]), abs=1e-6)
    greedy = _tgi_seq([1, 2, 3], [])  # no warpers in TGI either: the model's own
    greedy.params.logprobs = True
    out = sample(logits, [greedy])[0]
    assert out.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)
    with pytest.raises(SamplingError):
        SamplingParams(processed_logprobs=1).validate()


def test_frequency_penalty_per_context_must_be_a_bool():
    with pytest.raises(SamplingError, match="frequency_penalty_per_context"):
        SamplingParams(frequency_penalty_per_context=1).validate()


def test_the_context_counts_are_kept_up_to_date_not_recounted():
    """The penalties that read the whole context counted it again every step: O(context) per token."""
    from collections import Counter

    from engine.sampler import _context_counts

    s = Sequence("r", [1, 5, 2, 3, 1], SamplingParams(repetition_penalty=1.3))
    row = torch.zeros(12)
    first = _context_counts(s, row)
    read = []
    real = s.token_range
    s.token_range = lambda start, end=None: (read.append(start), real(start, end))[1]
    for t in (5, 9, 5):
        s.output_ids.append(t)
        counts = _context_counts(s, row)
    assert counts is first and read == [5, 6, 7]  # the same tensor, only the new token read each time
    assert {i: int(c) for i, c in enumerate(counts) if c} == Counter(s.tokens)
    wider = _context_counts(s, torch.zeros(16))  # another vocabulary width: counted again, in full
    assert wider is not first and int(wider.sum()) == s.num_tokens


def test_a_token_range_is_the_slice_of_the_context():
    s = Sequence("r", [1, 2, 3, 4], SamplingParams())
    s.output_ids = [5, 6, 7]
    for start in range(9):
        for end in range(start, 10):  # past the end too, as the scheduler asks
            assert s.token_range(start, end) == s.tokens[start:end], (start, end)
        assert s.token_range(start) == s.tokens[start:]


def _kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(row > float("-inf")).flatten().tolist())


@pytest.mark.parametrize("vocab", [50, 3000])
def test_min_p_and_typical_p_keep_what_transformers_keeps(vocab):
    # transformers' own warpers are the reference (what TGI and HF's generate apply): rows of each kind,
    # peaked, nearly flat and tied, each with its own value beside rows that leave the filter off
    from transformers.generation.logits_process import MinPLogitsWarper, TypicalLogitsWarper

    from engine.sampler import _filter

    g = torch.Generator().manual_seed(vocab)
    rows = torch.cat([torch.randn(3, vocab, generator=g) * 3, torch.randn(2, vocab, generator=g) * 0.01,
                      torch.randint(0, 4, (2, vocab), generator=g).float()])
    rows[0, :3] = float("-inf")  # impossible tokens (a logit bias of -inf, a mask) stay out
    n = len(rows)
    for value in (0.02, 0.3, 0.9):
        out = _filter(rows, [0] * n, [1.0] * n, [value] * n)
        ref = MinPLogitsWarper(value, min_tokens_to_keep=1)(None, rows.clone())
        assert [_kept(r) for r in out] == [_kept(r) for r in ref], value
        out = _filter(rows, [0] * n, [1.0] * n, None, [value] * n)
        ref = TypicalLogitsWarper(value, min_tokens_to_keep=1)(None, rows.clone())
        assert [_kept(r) for r in out] == [_kept(r) for r in ref], value
    # per row: off (0 / 1.0) beside on, and after top-k as transformers orders them
    out = _filter(rows[:3], [0, 0, 10], [1.0] * 3, [0.0, 0.3, 0.0], [1.0, 1.0, 0.5])
    assert torch.equal(out[0], rows[0])
    assert _kept(out[1]) == _kept(MinPLogitsWarper(0.3)(None, rows[1:2].clone())[0])
    top10 = rows[2].masked_fill(rows[2] < rows[2].topk(10).values[-1], float("-inf"))
    assert _kept(out[2]) == _kept(TypicalLogitsWarper(0.5)(None, top10.unsqueeze(0))[0])


def test_min_p_and_typical_p_narrow_the_draws():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0, 0.5]])  # probabilities 0.56 0.21 0.08 0.03 0 0.13
    # min_p 0.3: only tokens at least 0.3 x 0.56 likely (0 and 1); typical_p: the tokens whose surprisal
    # is closest to the entropy (1.21 nats), up to the one that crosses the mass: 1 (surprisal 1.58,
    # 0.21 of the mass) alone for 0.15, the best token too (0.58) for 0.3; token 5 (2.08) after them
    min_p = seq(temperature=1.0, min_p=0.3)
    assert {sample(logits, [min_p])[0].token for _ in range(400)} == {0, 1}
    for mass, kept in ((0.15, {1}), (0.3, {0, 1}), (0.85, {0, 1, 5})):
        typical = seq(temperature=1.0, typical_p=mass)
        assert {sample(logits, [typical])[0].token for _ in range(400)} == kept, mass
    for bad in (dict(min_p=-0.1), dict(min_p=1.5), dict(typical_p=0.0), dict(typical_p=1.1), dict(min_p="0.1")):
        with pytest.raises(SamplingError):
            SamplingParams(**bad).validate()


def test_a_bias_is_scaled_by_the_repetition_penalty_as_in_vllm():
    # vLLM adds logit_bias before its penalties; the bias came after the repetition penalty here
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.5]])
    s = Sequence("r", [0, 1], SamplingParams(repetition_penalty=1.3, logit_bias={0: 5.0, 1: -5.0}))
    s.output_ids = [3]
    (reported,) = _reported(logits, [_processed(s)])
    assert torch.allclose(reported, torch.log_softmax(torch.tensor([7.0 / 1.3, -4.0 * 1.3, 0.0, 0.5 / 1.3]), -1))


def _processed(s: Sequence) -> Sequence:
    s.params.processed_logprobs = True  # (what the request samples from is what it reports)
    return s


def test_allowed_token_ids_and_bad_words_ban_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, 0.5]])
    # only the allowed ones, greedy or drawn; the reported log-probabilities are the model's (vLLM's raw ones)
    greedy = sample(logits, [seq(allowed_token_ids=[1, 3], logprobs=True, top_logprobs=3)])[0]
    assert greedy.token == 1 and [t for t, _ in greedy.top] == [4, 0, 1]
    assert greedy.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    # as TGI reports them: over the allowed ones alone
    tgi = sample(logits, [seq(allowed_token_ids=[1, 3], logprobs=True, top_logprobs=3, processed_logprobs=True)])[0]
    assert [t for t, _ in tgi.top[:2]] == [1, 3] and tgi.top[2][1] == -9999.0
    drawn = seq(temperature=1.0, allowed_token_ids=[2, 5])
    assert {sample(logits, [drawn])[0].token for _ in range(200)} == {2, 5}
    # a one-token bad word is never generated; a longer one loses its last token only after the rest of it
    assert sample(logits, [seq(bad_words_ids=[[4]])])[0].token == 0
    assert sample(logits, [seq(output=[7, 9], bad_words_ids=[[9, 4]])])[0].token == 0
    assert sample(logits, [seq(output=[9, 7], bad_words_ids=[[9, 4]])])[0].token == 4
    assert sample(logits, [seq(output=[8, 9], bad_words_ids=[[7, 9, 4], [8, 9, 0]])])[0].token == 4
    for bad in (dict(allowed_token_ids=[-1]), dict(bad_words_ids=[[]]), dict(bad_words_ids=[3])):
        with pytest.raises(SamplingError):
            SamplingParams(**bad).validate()


def test_out_of_vocabulary_allowed_and_bad_word_ids_are_refused(make_engine):
    eng = make_engine("tiny")
    for kw in (dict(allowed_token_ids=[3, eng.vocab_size]), dict(bad_words_ids=[[3, eng.vocab_size + 5]])):
        with pytest.raises(RequestError, match="outside the vocabulary"):
            eng.add_request(PROMPT, SamplingParams(**kw))


def test_allowed_token_ids_that_bans_leave_empty_are_refused(make_engine):
    # with no token left the sampler drew token 0, allowed or not: [0, 0, 0, 257] for these
    eng = make_engine("tiny")
    eos = min(eng.eos_ids)
    for kw in (dict(min_tokens=3, allowed_token_ids=[eos]), dict(allowed_token_ids=[50, 60], bad_words_ids=[[50], [60]]),
               dict(min_tokens=1, allowed_token_ids=[50, 60], bad_words_ids=[[50]], stop_token_ids=[60])):
        with pytest.raises(RequestError, match="leave no token to generate"):
            eng.add_request(PROMPT, SamplingParams(max_new_tokens=4, **kw))
    # what is left is generated: a longer bad word bans its last token only after the rest of it
    ok = dict(min_tokens=3, allowed_token_ids=[eos, 50], bad_words_ids=[[60, 50]])
    assert eng.generate([PROMPT], SamplingParams(max_new_tokens=4, **ok))[0].output_ids[:3] == [50, 50, 50]
    assert eng.generate([PROMPT], SamplingParams(max_new_tokens=2, min_tokens=2, ignore_eos=True,
                                                 allowed_token_ids=[eos]))[0].output_ids == [eos, eos]


def test_a_temperature_past_the_dtypes_range_still_draws_uniformly():
    # 1e39 became inf in float32, every row NaN, and the draw fell back to the first allowed token
    logits = torch.randn(1, 10)
    drawn = seq(temperature=1e39, allowed_token_ids=[3, 5, 7])
    assert {sample(logits, [drawn])[0].token for _ in range(100)} == {3, 5, 7}


def test_a_step_whose_constraints_leave_no_token_ends_that_request_with_the_reason(make_engine):
    # bans that only bite as the output grows (a longer bad word, stop tokens covering the vocabulary
    # before min_tokens) passed validation, and each such step drew token 0: [300, 0, 300, 0, 300, 0]
    eng = make_engine("tiny")
    for kw in (dict(allowed_token_ids=[300], bad_words_ids=[[300, 300]]),
               dict(stop_token_ids=list(range(eng.vocab_size)), min_tokens=3),
               dict(stop_token_ids=list(range(1, eng.vocab_size)), bad_words_ids=[[0]], min_tokens=3,
                    temperature=1.0, seed=3)):
        other = eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
        rid = eng.add_request(PROMPT, SamplingParams(max_new_tokens=6, **kw))
        events = []
        while eng.has_work():
            events += eng.step()
        mine = [e for e in events if e.request_id == rid]
        assert 0 not in [e.token_id for e in mine], kw
        assert mine[-1].finish_reason == "error" and mine[-1].error_kind == "validation"
        assert "no token is left to generate" in mine[-1].error
        assert [e for e in events if e.request_id == other][-1].finish_reason == "length"  # (the batch goes on)
    eng.check_invariants()
    assert eng.kv.allocator.num_in_use == 0  # (every block back)


def test_reported_log_probabilities_keep_their_order_past_the_impossible_ones():
    # a possible token far below -9999 was reported as it was, under an impossible one's -9999
    logits = torch.tensor([[5.0, -0.22, 0.0, 0.0]])  # token 1 is in the context: penalized to -220,000
    s = sample(logits, [seq(allowed_token_ids=[0, 1], repetition_penalty=1e6, logprobs=True, top_logprobs=3,
                            processed_logprobs=True)])[0]
    values = [lp for _, lp in s.top]
    assert values == sorted(values, reverse=True) and min(values) == -9999.0


def test_extreme_repetition_penalties_neither_fail_nor_break_the_distribution(make_engine):
    eng = make_engine("tiny")
    rid = eng.add_request(PROMPT, SamplingParams(repetition_penalty=1e-300, logprobs=True, top_logprobs=2,
                                                 max_new_tokens=3))
    tiny = []
    while eng.has_work():
        tiny += [e for e in eng.step() if e.request_id == rid]
    assert tiny[-1].finish_reason == "length" and all(e.logprob > -9999.0 for e in tiny)  # (inf logits: NaN)
    # an int past int64 failed inside the step ("int too big to convert"); as a float it is a penalty
    huge = eng.generate([PROMPT], SamplingParams(repetition_penalty=10**30, max_new_tokens=3))[0]
    assert huge.finish_reason == "length"
    with pytest.raises(RequestError, match="finite number"):
        eng.add_request(PROMPT, SamplingParams(repetition_penalty=10**400))
    with pytest.raises(RequestError, match="outside the vocabulary"):  # (True is no token id)
        eng.add_request(PROMPT, SamplingParams(logit_bias={True: 5.0}))


def test_top_p_is_measured_among_what_min_p_left_as_in_vllm():
    # probabilities .30 .25 .20 .10 .05 ...: min_p 0.3 keeps the first four (>= .09); top_p 0.8 of those
    # (renormalised: .35 .29 .24 .12) keeps three, where top_p over the whole row kept four
    probs = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.05, 0.04, 0.03, 0.03])
    s = seq(temperature=1.0, top_p=0.8, min_p=0.3)
    assert {sample(probs.log().unsqueeze(0), [s])[0].token for _ in range(600)} == {0, 1, 2}


def test_a_requests_fixed_tensors_are_made_once_and_its_counts_follow_its_output():
    # logit_bias and allowed_token_ids were tensors made anew at every token (16 ms a step for 262k ids, on
    # the thread every request shares), and the output's counts a Counter rebuilt at every token
    torch.manual_seed(2)
    logits = torch.randn(1, 12)
    s = seq([5, 9, 5], logit_bias={3: 2.0}, allowed_token_ids=[1, 3, 3, 5, 9], frequency_penalty=1.5,
            presence_penalty=0.5, logprobs=True, top_logprobs=12, processed_logprobs=True)
    first = sample(logits, [s])[0]
    made = s.fixed_tensors
    assert made[3].tolist() == [1, 3, 5, 9]  # (duplicates once)
    want = logits[0].clone()
    want[3] += 2.0
    want[5] -= 1.5 * 2 + 0.5
    want[9] -= 1.5 * 1 + 0.5
    want[[0, 2, 4, 6, 7, 8, 10, 11]] = float("-inf")
    assert dict(first.top)[5] == pytest.approx(torch.log_softmax(want, -1)[5].item(), abs=1e-5)
    s.output_ids.append(3)  # the next step: one more token counted, the tensors kept
    second = sample(logits, [s])[0]
    want[3] -= 1.5 + 0.5
    assert s.fixed_tensors is made and s.output_counts.counted == 4
    assert dict(second.top)[3] == pytest.approx(torch.log_softmax(want, -1)[3].item(), abs=1e-5)
