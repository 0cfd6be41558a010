"""Cache-aware autoscaling of the LLM deployment: what Serve's controller asks every control loop.

Serve's default policy counts requests in flight, and a prefix cache changes what a replica is worth:

- A fleet whose caches are too small for its working set computes the same prefixes again and again
  while its queues stay short. Each replica counts the prompt blocks it computes again soon after it
  evicted them (its ghost list); when they are more than ``recompute_share`` of the prompt tokens, one
  more replica adds a cache's worth of room (while the replicas' latest reports still show it). A
  working set far beyond the fleet (every prompt new) recomputes nothing the ghost lists remember, so
  it adds no replica that would not help.
- Running sequences that fill the KV pools (``target_kv_usage``) ask for more room too.
- Removing a replica throws its cache away: the policy scales down one replica at a time, and only when
  the blocks that served a hit in the last minute, with the blocks its running sequences hold, fit in
  the replicas that stay with room to spare (``working_set_fill``), and less than half of
  ``recompute_share`` is being recomputed. A block several replicas hold (a prefix hot enough for the
  router to copy) is in each one's count, but the replicas that stay need it at most once each: the
  copies kept count at most ``replicas left x distinct hot blocks`` (the hub merges every replica's
  sketch of its working set into the count of distinct ones, ``fleet_hot_blocks``). A fleet that grew
  because prefixes were computed again keeps that size for ``recompute_hold_s`` while traffic lasts: the
  minute of hits misses prefixes that come back every few minutes, and such a fleet went down and up
  again every few minutes, each time loading a model and throwing a cache away.
- After the fleet changes, Serve's averages still cover the old fleet for a look-back window (and a
  metrics interval): until then, and while a replica it asked for is still starting, only requests in
  flight may add replicas, and none are removed. A replica still not running after ``starting_grace_s``
  (no node or GPU free for it, a start that fails each time) no longer holds the fleet: the policy
  decides on the running ones, and a decision under Serve's target cancels it, as Serve's policy would.

The requests-in-flight target still holds (``target_ongoing_requests``). Pure Python: Serve applies
``min_replicas``/``max_replicas``, the scaling factors and the up/down delays around it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ReplicaSignals:
    """One replica's ``record_autoscaling_stats``, each averaged by Serve over its look-back window."""

    ongoing: float = 0.0  # requests running or waiting in its engine
    kv_usage: float = 0.0  # share of its KV pool held by running sequences
    prompt_tps: float = 0.0  # prompt tokens looked up in its cache, per second
    recompute_tps: float = 0.0  # of which computed again soon after their eviction, per second
    hot_blocks: float = 0.0  # cached blocks that served a hit in the last minute (its working set)
    total_blocks: float = 0.0  # its KV pool
    fleet_hot_blocks: float = 0.0  # the distinct ones among every replica's (the same for all; 0: unknown)


@dataclass(frozen=True)
class Knobs:
    target_ongoing_requests: float = 8.0
    target_kv_usage: float = 0.8
    recompute_share: float = 0.1
    working_set_fill: float = 0.8
    min_prompt_tps: float = 16.0  # fewer prompt tokens per second than this: too few to judge the share
    recompute_hold_s: float = 1800.0  # after growing for recomputed prefixes, no smaller fleet this long
    starting_grace_s: float = 600.0  # a replica asked for and not running after this long holds nothing


def desired_replicas(current: int, total_requests: float, signals: list[ReplicaSignals], k: Knobs,
                     settled: bool = True, latest_share: float | None = None, target: int = 0,
                     hold: int = 0) -> tuple[float, str]:
    """How many replicas the fleet wants (before Serve's bounds and delays), and why. ``settled``: the
    averages cover only the current fleet (not so after a replica came or went: then requests may
    scale up, and nothing scales down). ``latest_share``: the recomputed share in the replicas' latest
    reports; a replica is added for recomputation only while it goes on (after a scale-up the router
    takes a while to split the prefixes between the caches, and the averages remember that). ``target``:
    the replicas Serve runs or is bringing up; until the averages can be trusted, none of them is taken
    away (replicas still starting included: an unsettled fleet is one that just grew). ``hold``: the
    fleet grew to this many for recomputed prefixes lately; while traffic lasts, it keeps them."""
    by_requests = total_requests / k.target_ongoing_requests
    if current == 0 or not signals or not settled:
        return max(by_requests, float(current), float(target)), "requests"
    seen = len(signals)
    by_kv = current * sum(s.kv_usage for s in signals) / seen / k.target_kv_usage
    prompt = sum(s.prompt_tps for s in signals)
    share = sum(s.recompute_tps for s in signals) / prompt if prompt >= k.min_prompt_tps else 0.0
    still = latest_share is None or latest_share > k.recompute_share
    by_cache = current + 1.0 if share > k.recompute_share and still else 0.0
    desired, reason = max((by_requests, "requests"), (by_kv, "kv usage"), (by_cache, "recomputed prefixes"))
    if desired >= current:
        return desired, reason
    pool = sum(s.total_blocks for s in signals) / seen
    scale = current / seen  # replicas that did not report count as the mean of those that did
    working_set = sum(s.hot_blocks for s in signals) * scale
    if current > 1 and (distinct := max(s.fleet_hot_blocks for s in signals)) > 0:
        # each block keeps at most one copy per replica left: sum(min(copies, current - 1)) over blocks
        # (not when going to zero: then nothing stays to hold what is hot)
        working_set = min(working_set, distinct * (current - 1))
    running = sum(s.kv_usage * s.total_blocks for s in signals) * scale  # moves to the replicas that stay
    if share > k.recompute_share / 2:
        return float(current), "recomputed prefixes"
    if current <= hold and prompt >= k.min_prompt_tps:
        return float(current), "recomputed prefixes lately"
    if working_set + running > k.working_set_fill * pool * (current - 1):
        return float(current), "working set"
    return max(desired, current - 1.0), reason  # one cache at a time


class CacheAwarePolicy:
    """Serve's custom autoscaling policy (``AutoscalingPolicy(policy_function=...)``; the keyword
    arguments are ``Knobs`` fields, the requests target comes from the autoscaling config)."""

    def __init__(self, **knobs: float):
        self.knobs = Knobs(**knobs)  # a wrong name fails when Serve deploys the policy, not at every decision
        self._last_reason = ""
        self._fleet: tuple[int, float] | None = None  # (running replicas, since when)
        self._starting_since: float | None = None  # since when Serve's target is over the running count
        # (replicas, when) it last asked for because prefixes were computed again, while it still asks for more
        self._asked: tuple[int, float] | None = None
        self._grew: tuple[int, float] = (0, float("-inf"))  # (replicas, when) of the last growth for recomputation

    def __call__(self, ctx) -> tuple[float, dict]:
        metrics = ctx.aggregated_metrics or {}
        replicas = set().union(*(m.keys() for m in metrics.values())) if metrics else set()
        fields = ReplicaSignals.__dataclass_fields__
        signals = [ReplicaSignals(**{f: float(metrics.get(f, {}).get(r, 0.0)) for f in fields}) for r in replicas]
        k = dataclasses.replace(self.knobs, target_ongoing_requests=ctx.config.get_target_ongoing_requests())
        current, now = ctx.current_num_replicas, time.time() if ctx.current_time is None else ctx.current_time
        if self._fleet is None or self._fleet[0] != current:
            if self._fleet is not None and current > self._fleet[0] and self._asked is not None:
                asked, when = self._asked
                if now - when <= k.starting_grace_s:  # the replica it asked for runs: that size is held, no more
                    self._grew = (min(current, asked), now)  # (than requests, or a replaced replica, grew it to)
                self._asked = None
            self._fleet = (current, now)
        # the window Serve averages over must no longer reach back to the fleet before its last change
        # (replicas push their reports every metrics interval: the newest may be that old); and no
        # replica may still be starting: Serve reads an answer under its target as a scale-down, and
        # "keep the fleet" (the running count) would cancel a replica still loading its model
        starting = ctx.target_num_replicas > current
        self._starting_since = (self._starting_since if self._starting_since is not None else now) if starting else None
        stuck = starting and now - self._starting_since >= k.starting_grace_s
        settled = (now - self._fleet[1] >= ctx.config.look_back_period_s + ctx.config.metrics_interval_s
                   and (not starting or stuck))
        hold = self._grew[0] if now - self._grew[1] < k.recompute_hold_s else 0
        desired, reason = desired_replicas(current, ctx.total_num_requests, signals, k, settled,
                                           latest_share(ctx.raw_metrics, k.min_prompt_tps), ctx.target_num_replicas,
                                           hold)
        if reason == "recomputed prefixes" and desired > current:
            self._asked = (math.ceil(desired), now)
        elif desired <= current:
            self._asked = None  # it asks no more: Serve, which waits upscale_delay_s, never acts on that ask
        if reason != self._last_reason and reason != "requests":
            log.info("cache-aware autoscaling of %s: %.2f replicas for now (%s)", ctx.deployment_name, desired, reason)
        self._last_reason = reason
        return desired, {}


def latest_share(raw: dict | None, min_prompt_tps: float) -> float | None:
    """The recomputed share of prompt tokens in each replica's latest report (Serve's raw time series:
    ``{metric: {replica: [TimeStampedValue(timestamp, value), ...]}}``): 0 when the traffic has all but
    stopped, None without reports."""
    if not raw:
        return None
    latest = {name: sum(series[-1].value for series in raw.get(name, {}).values() if series)
              for name in ("prompt_tps", "recompute_tps")}
    if latest["prompt_tps"] < min_prompt_tps:
        return 0.0
    return latest["recompute_tps"] / latest["prompt_tps"]
