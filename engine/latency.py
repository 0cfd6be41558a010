"""Latency histograms: counted by the engine as each sample comes, exposed by the metrics hub.

Pure Python (no torch, no Ray): the engine and the metrics exposition share the buckets from here."""

from __future__ import annotations

import threading
from bisect import bisect_left

# up to the minutes an overloaded service's line can take (the ingress's TTFT includes Serve's queue,
# which has no bound unless --max-concurrent-requests sets one) and a long answer runs: past the last
# bound every sample is +Inf, and histogram_quantile then says the last bound for every quantile
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 2400.0)


class Histogram:
    """Per-bucket counts (last: +Inf) and the sum of every sample, counted as it comes: however late the
    metrics read them, none is lost. Safe to copy from another thread (the ingress's heartbeat copies
    what its event loop observes): a copy's sum and counts are of the same samples, as Prometheus's
    ``histogram_quantile`` and mean (sum / count) assume."""

    __slots__ = ("buckets", "counts", "sum", "_lock")

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()  # uncontended but for a copy: well under a microsecond a sample

    def observe(self, x: float) -> None:
        i = bisect_left(self.buckets, x)  # the first bucket whose bound is >= x, as Prometheus
        with self._lock:
            self.counts[i] += 1
            self.sum += x

    def to_dict(self) -> dict:
        with self._lock:
            return {"counts": list(self.counts), "sum": self.sum}
