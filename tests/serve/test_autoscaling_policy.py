"""The cache-aware autoscaling policy: pure decisions, and the same policy behind Serve's own wrapper
(bounds, delays) with Serve's real context and config objects."""

from __future__ import annotations

import pytest

from deployments.autoscaling_policy import CacheAwarePolicy, Knobs, ReplicaSignals, desired_replicas

K = Knobs(target_ongoing_requests=8)


def fleet(n, **kw):
    base = dict(ongoing=1.0, kv_usage=0.0, prompt_tps=1000.0, recompute_tps=0.0, hot_blocks=50.0,
                total_blocks=1000.0)
    return [ReplicaSignals(**{**base, **kw}) for _ in range(n)]


def test_requests_in_flight_scale_as_serves_default_does():
    assert desired_replicas(2, 40.0, fleet(2), K) == (5.0, "requests")


def test_prefixes_computed_again_add_a_replica_while_queues_are_short():
    desired, reason = desired_replicas(2, 2.0, fleet(2, recompute_tps=300.0), K)
    assert (desired, reason) == (3.0, "recomputed prefixes")  # Serve's default would want 0.25
    # a trickle of prompts says nothing about the share: that quiet fleet may even shrink
    assert desired_replicas(2, 2.0, fleet(2, prompt_tps=4.0, recompute_tps=3.0), K) == (1.0, "requests")


def test_running_sequences_that_fill_the_pools_ask_for_room():
    desired, reason = desired_replicas(2, 2.0, fleet(2, kv_usage=0.96), K)
    assert reason == "kv usage" and desired == pytest.approx(2.4)


def test_scaling_down_goes_one_replica_at_a_time():
    assert desired_replicas(4, 0.0, fleet(4), K) == (3.0, "requests")
    # sequences still running hold the last replica that requests alone would let go (none are queued)
    assert desired_replicas(1, 0.0, fleet(1, kv_usage=0.2, hot_blocks=0.0), K) == (1.0, "working set")


def test_the_working_set_holds_a_replica_the_others_cannot_make_room_for():
    # 4 x 700 hot blocks do not fit in 3 pools of 1000 at 80 %: keep all four
    assert desired_replicas(4, 0.0, fleet(4, hot_blocks=700.0), K) == (4.0, "working set")
    assert desired_replicas(4, 0.0, fleet(4, hot_blocks=550.0), K)[0] == 3.0
    # scaling to zero: only when nothing was hit within the window
    assert desired_replicas(1, 0.0, fleet(1, hot_blocks=1.0), K)[0] == 1.0
    assert desired_replicas(1, 0.0, fleet(1, hot_blocks=0.0), K)[0] == 0.0


def test_a_prefix_every_replica_holds_needs_only_one_copy_on_each_that_stays():
    # 4 pools of 10k sharing 6.5k hot blocks: 26k summed do not fit in 3 x 8k, 3 copies of 6.5k do
    shared = dict(hot_blocks=6_500.0, total_blocks=10_000.0)
    assert desired_replicas(4, 0.0, fleet(4, **shared), K) == (4.0, "working set")  # no distinct count
    assert desired_replicas(4, 0.0, fleet(4, **shared, fleet_hot_blocks=6_500.0), K)[0] == 3.0
    # 6.5k distinct blocks each (nothing shared): the distinct count changes nothing
    assert desired_replicas(4, 0.0, fleet(4, **shared, fleet_hot_blocks=26_000.0), K) == (4.0, "working set")
    # half shared (4 x 3.25k) and 4 x 3.25k of their own: 16.25k distinct; the 3 that stay may need
    # 3 x 16.25k, more than the 26k summed, which stands
    assert desired_replicas(4, 0.0, fleet(4, **shared, fleet_hot_blocks=16_250.0), K)[1] == "working set"
    # going to zero: nothing stays to hold what was hit, however few distinct blocks that is
    assert desired_replicas(1, 0.0, fleet(1, hot_blocks=5.0, fleet_hot_blocks=5.0), K)[0] == 1.0


def test_the_blocks_running_sequences_hold_count_against_the_room_that_stays():
    # 2 x 22 hot blocks fit in one pool of 64 at 80 %, but not with the 2 x 26 blocks running there:
    # removing a replica would bring back the recomputation that added it
    assert desired_replicas(2, 0.0, fleet(2, hot_blocks=22.0, kv_usage=0.4, total_blocks=64.0), K) == (2.0, "working set")
    assert desired_replicas(2, 0.0, fleet(2, hot_blocks=22.0, kv_usage=0.0, total_blocks=64.0), K)[0] == 1.0


def test_some_recomputation_holds_a_fleet_that_just_grew_for_it():
    assert desired_replicas(3, 0.0, fleet(3, hot_blocks=0.0, recompute_tps=70.0), K) == (3.0, "recomputed prefixes")


def test_unsettled_or_unmeasured_fleets_never_scale_down_but_requests_still_scale_up():
    for signals, settled in ((fleet(3), False), ([], True)):
        assert desired_replicas(3, 0.0, signals, K, settled) == (3.0, "requests")
        assert desired_replicas(3, 64.0, signals, K, settled) == (8.0, "requests")
    # nor does recomputation add a second replica before the first one's effect is measured
    assert desired_replicas(3, 0.0, fleet(3, recompute_tps=500.0), K, settled=False)[0] == 3.0
    assert desired_replicas(0, 3.0, [], K) == (3 / 8, "requests")
    # Serve is starting the first replica (none runs yet): it is not idle, keep it coming
    assert desired_replicas(0, 0.0, [], K, target=1) == (1.0, "requests")
    # nor are replicas Serve is still starting cancelled (the fleet just grew, or none has reported yet)
    for signals, settled in ((fleet(3), False), ([], True)):
        assert desired_replicas(3, 0.0, signals, K, settled, target=5) == (5.0, "requests")
    # once the averages are the fleet's own, they decide, as for running replicas
    assert desired_replicas(3, 0.0, fleet(3), K, target=5) == (2.0, "requests")


def test_recomputation_adds_a_replica_only_while_it_goes_on():
    thrash = fleet(2, recompute_tps=300.0)
    assert desired_replicas(2, 0.0, thrash, K, latest_share=0.3)[0] == 3.0
    # the averages still remember the thrash before the router split the prefixes: the latest reports do not
    assert desired_replicas(2, 0.0, thrash, K, latest_share=0.0) == (2.0, "recomputed prefixes")


class Ctx:
    """What the policy reads of Serve's AutoscalingContext."""

    def __init__(self, current, metrics, now, requests=0.0, look_back=30.0, raw=None, target=None):
        from ray.serve.config import AutoscalingConfig

        self.deployment_name, self.current_num_replicas, self.current_time = "llm", current, now
        self.aggregated_metrics, self.total_num_requests = metrics, requests
        self.raw_metrics, self.target_num_replicas = raw, current if target is None else target
        self.config = AutoscalingConfig(target_ongoing_requests=8, look_back_period_s=look_back)


def test_the_policy_reads_serves_per_replica_metrics_and_waits_a_window_after_a_change():
    with pytest.raises(TypeError):
        CacheAwarePolicy(recompute_shares=0.1)  # a wrong name fails when Serve deploys it
    policy = CacheAwarePolicy(recompute_share=0.1)
    thrash = {"prompt_tps": {"r1": 500.0, "r2": 500.0}, "recompute_tps": {"r1": 200.0, "r2": 0.0},
              "total_blocks": {"r1": 1000.0, "r2": 1000.0}}  # metrics a replica did not report count as 0
    # a new fleet: its window (30 s, and the 10 s a report may be late) is not all its own yet
    assert policy(Ctx(2, thrash, now=0.0)) == (2.0, {})
    assert policy(Ctx(2, thrash, now=39.0))[0] == 2.0
    assert policy(Ctx(2, thrash, now=40.0))[0] == 3.0
    assert policy(Ctx(3, thrash, now=41.0))[0] == 3.0  # grew: wait again
    assert policy(Ctx(3, thrash, now=81.0))[0] == 4.0
    assert policy(Ctx(3, {}, now=100.0, requests=40.0))[0] == 5.0  # nothing reported: requests only
    # the latest reports (Serve's raw series) say the recomputation stopped: no fourth replica
    from ray.serve._private.common import TimeStampedValue as V

    raw = {"prompt_tps": {"r1": [V(1.0, 500.0), V(2.0, 500.0)], "r2": [V(1.0, 500.0), V(2.0, 500.0)]},
           "recompute_tps": {"r1": [V(1.0, 400.0), V(2.0, 0.0)], "r2": [V(1.0, 0.0), V(2.0, 0.0)]}}
    assert policy(Ctx(3, thrash, now=101.0, raw=raw))[0] == 3.0
    raw["prompt_tps"] = {"r1": [V(2.0, 1.0)]}  # and the traffic all but stopped: nor then
    assert policy(Ctx(3, thrash, now=102.0, raw=raw))[0] == 3.0
    raw = {"prompt_tps": {"r1": [V(2.0, 500.0)]}, "recompute_tps": {"r1": [V(2.0, 200.0)]}}
    assert policy(Ctx(3, thrash, now=103.0, raw=raw))[0] == 4.0


def test_behind_serves_own_wrapper_with_its_context_and_config():
    from ray.serve._private.common import DeploymentID
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=8, look_back_period_s=11,
                               upscale_delay_s=0, downscale_delay_s=0)
    wrapped = _apply_autoscaling_config(CacheAwarePolicy())
    thrash = {"prompt_tps": {"a": 900.0, "b": 900.0, "c": 900.0}, "recompute_tps": {"a": 400.0, "b": 0.0, "c": 0.0},
              "total_blocks": {"a": 100.0, "b": 100.0, "c": 100.0}}

    def decide(current, metrics, now, state):
        ctx = AutoscalingContext(
            deployment_id=DeploymentID(name="llm", app_name="app"), deployment_name="llm", app_name="app",
            current_num_replicas=current, target_num_replicas=current, running_replicas=[],
            total_num_requests=1.0, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
            capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state=state,
            last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=config)
        return wrapped(ctx)

    n, state = decide(3, thrash, 0.0, {})
    assert n == 3  # a new fleet: its window is not all its own yet
    n, state = decide(3, thrash, 25.0, state)  # 11 s window, 10 s metrics interval
    assert n == 4
    quiet = {k: {r: (0.0 if k == "recompute_tps" else v) for r, v in m.items()} for k, m in thrash.items()}
    n, state = decide(3, quiet, 40.0, state)
    assert n == 2  # (the fourth it asked for never came: nothing holds the three)


def test_a_replica_still_starting_is_not_cancelled_when_recomputation_eases():
    """Asked for because prefixes were computed again, a third replica is still loading its model when the
    recomputed share falls into the band that neither adds nor removes. "Keep the fleet" was the two
    running replicas, under Serve's target of three: Serve took it for a scale-down and, after its delay,
    cancelled the replica that was loading (and asked for it again when the share rose)."""
    policy = CacheAwarePolicy(recompute_share=0.1)

    def fleet_of(n, recompute):
        names = [f"r{i}" for i in range(n)]
        return {"prompt_tps": dict.fromkeys(names, 1000.0), "recompute_tps": dict.fromkeys(names, recompute),
                "hot_blocks": dict.fromkeys(names, 900.0), "total_blocks": dict.fromkeys(names, 1000.0)}

    assert policy(Ctx(2, fleet_of(2, 150.0), now=0.0))[0] == 2.0  # (a new fleet: a window first)
    assert policy(Ctx(2, fleet_of(2, 150.0), now=50.0))[0] == 3.0
    for now in (55.0, 100.0, 200.0):  # the third is still starting; the share eases to 0.08
        assert policy(Ctx(2, fleet_of(2, 80.0), now=now, target=3))[0] == 3.0
    assert policy(Ctx(3, fleet_of(3, 80.0), now=210.0))[0] == 3.0  # it runs: a window, then the band holds it
    assert policy(Ctx(3, fleet_of(3, 80.0), now=260.0)) == (3.0, {})


def _idle_fleet(n: int, prompt_tps: float = 0.0) -> dict:
    names = [f"r{i}" for i in range(n)]
    return {"prompt_tps": dict.fromkeys(names, prompt_tps), "recompute_tps": dict.fromkeys(names, 0.0),
            "hot_blocks": dict.fromkeys(names, 0.0), "total_blocks": dict.fromkeys(names, 1000.0)}


def test_a_replica_that_never_starts_stops_holding_the_fleet():
    """A replica asked for that never runs (no node or GPU free for it): Serve's target stayed over the
    running count for good, the fleet counted as never settled, and it kept every replica (and the
    pending one) at zero traffic forever. Past the grace it decides on the running ones, as Serve's does."""
    policy = CacheAwarePolicy()
    for now in (0.0, 100.0, 590.0):
        assert policy(Ctx(4, _idle_fleet(4), now=now, target=5))[0] == 5.0
    assert policy(Ctx(4, _idle_fleet(4), now=600.0, target=5))[0] == 3.0  # one at a time, as ever
    # one that starts within the grace is waited for, and a later one gets its own grace
    policy = CacheAwarePolicy()
    assert policy(Ctx(4, _idle_fleet(4), now=0.0, target=5))[0] == 5.0
    assert policy(Ctx(5, _idle_fleet(5), now=300.0))[0] == 5.0  # (a new fleet: a window first)
    assert policy(Ctx(5, _idle_fleet(5), now=400.0, target=6))[0] == 6.0
    assert policy(Ctx(5, _idle_fleet(5), now=900.0, target=6))[0] == 6.0
    assert policy(Ctx(5, _idle_fleet(5), now=1000.0, target=6))[0] == 4.0


def test_a_fleet_grown_for_recomputed_prefixes_keeps_its_size_while_traffic_lasts():
    """Prefixes that come back every few minutes: the minute of hits that scaling down weighs misses
    half of them, so the grown fleet went down, recomputed them, and grew again, every few minutes."""
    policy = CacheAwarePolicy(recompute_share=0.1)
    thrash = {**_idle_fleet(2, 1000.0), "recompute_tps": {"r0": 300.0, "r1": 300.0}}
    assert policy(Ctx(2, thrash, now=0.0))[0] == 2.0
    assert policy(Ctx(2, thrash, now=50.0))[0] == 3.0
    calm = _idle_fleet(3, 1000.0)  # nothing recomputed, the minute's hits fit in two
    for now in (100.0, 1000.0, 1890.0):  # (the third runs from 100 s)
        assert policy(Ctx(3, calm, now=now)) == (3.0, {})
    assert policy(Ctx(3, calm, now=1900.0))[0] == 2.0  # the hold is over
    # the traffic stopped: nothing to keep the caches for
    policy._grew = (3, 1900.0)
    assert policy(Ctx(3, _idle_fleet(3), now=1950.0))[0] == 2.0


def test_only_the_replica_asked_for_recomputed_prefixes_is_held():
    """The hold took whatever the fleet grew to within the start grace of an ask: a traffic ramp after it
    (or an ask Serve never acted on, followed by one) kept the whole ramp's fleet for 30 minutes after the
    load was gone."""
    policy = CacheAwarePolicy(recompute_share=0.1)
    busy = {**_idle_fleet(2, 1000.0), "recompute_tps": {"r0": 300.0, "r1": 300.0}}
    assert policy(Ctx(2, _idle_fleet(2, 1000.0), now=0.0))[0] == 2.0
    assert policy(Ctx(2, busy, now=50.0))[0] == 3.0
    policy(Ctx(3, _idle_fleet(3, 1000.0), now=60.0))  # the replica it asked for runs
    assert policy(Ctx(3, _idle_fleet(3, 1000.0), now=120.0, requests=48.0))[0] == 6.0  # a ramp of requests
    policy(Ctx(6, _idle_fleet(6, 1000.0), now=130.0, requests=48.0))
    assert policy(Ctx(6, _idle_fleet(6, 1000.0), now=300.0, requests=4.0)) == (5.0, {})  # (3 held, not 6)
    # an ask that lapses before Serve acts on it holds nothing a later ramp brings
    policy = CacheAwarePolicy(recompute_share=0.1)
    policy(Ctx(2, _idle_fleet(2, 1000.0), now=0.0))
    assert policy(Ctx(2, busy, now=50.0))[0] == 3.0
    assert policy(Ctx(2, _idle_fleet(2, 1000.0), now=55.0, requests=16.0))[0] == 2.0  # it asks no more
    assert policy(Ctx(2, _idle_fleet(2, 1000.0), now=120.0, requests=48.0))[0] == 6.0
    policy(Ctx(6, _idle_fleet(6, 1000.0), now=130.0, requests=48.0))
    assert policy(Ctx(6, _idle_fleet(6, 1000.0), now=300.0, requests=4.0)) == (5.0, {})
