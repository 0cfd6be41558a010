"""Latency histograms: the engine counts every sample as it comes, so none is lost however rarely the
replica's snapshot reads them (a bounded queue drained by the snapshot dropped ITL samples under load)."""

from __future__ import annotations

import types

from deployments import metrics
from deployments.llm_server import LLMServer
from engine.latency import Histogram
from engine.sequence import SamplingParams


def test_a_sample_counts_in_the_first_bucket_whose_bound_it_does_not_pass():
    h = Histogram((0.1, 1.0))
    for x in (0.0, 0.1, 0.1000001, 1.0, 1.5, float("inf")):
        h.observe(x)
    assert h.counts == [2, 2, 2]  # le=0.1: 0.0 and the bound itself; le=1.0; +Inf
    text = metrics.render({"r": {"ttft": Histogram(metrics.HISTOGRAMS["radixserve_time_to_first_token_seconds"][2])
                                 .to_dict()}})
    assert 'radixserve_time_to_first_token_seconds_bucket{replica="r",le="+Inf"} 0' in text


def test_the_buckets_resolve_an_overloaded_line_and_a_long_answer():
    """TTFT's last bound was 30 s (E2E's 300 s): the minutes an overloaded service's line takes were all
    +Inf, and every quantile read 30 s."""
    from engine.latency import E2E_BUCKETS, TTFT_BUCKETS

    for buckets, slow in ((TTFT_BUCKETS, (35.0, 50.0, 100.0, 300.0)), (E2E_BUCKETS, (400.0, 900.0, 1800.0))):
        h = Histogram(buckets)
        for x in slow:
            h.observe(x)
        assert h.counts[-1] == 0 and len({i for i, c in enumerate(h.counts) if c}) == len(slow)


def snapshot(engine) -> dict:
    """The replica's snapshot, without Ray (only what it reads of the replica)."""
    replica = types.SimpleNamespace(directory=None, warmup_report={"prefixes": 0, "tokens": 0})
    return LLMServer._snapshot(replica, engine)


def test_more_tokens_than_a_snapshot_period_held_are_all_counted(make_engine):
    eng = make_engine("tiny", max_batch_total_tokens=8192)
    n, new_tokens = 40, 110  # 4,360 inter-token gaps between two snapshots: more than the 4,096 kept
    eng.generate([[1 + i, 2, 3, 4, 5, 6, 7, 8] for i in range(n)],
                 SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    first = snapshot(eng)
    itl = sum(first["itl"]["counts"])
    assert itl == n * (new_tokens - 1) > 4096
    assert sum(first["ttft"]["counts"]) == n and sum(first["e2e"]["counts"]) == n
    assert itl + n == first["generated_tokens"]  # each token: its first, or a gap after another
    assert first["itl"]["sum"] > 0
    assert snapshot(eng)["itl"] == first["itl"]  # cumulative: reading takes nothing away
    text = metrics.render({"r": first})
    assert f'radixserve_inter_token_latency_seconds_count{{replica="r"}} {float(itl)}' in text
