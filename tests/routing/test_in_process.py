"""The ingress's shared histograms: the event loop observes them while the heartbeat thread copies them."""

from __future__ import annotations

import sys
import threading

from engine.latency import TTFT_BUCKETS, Histogram


def test_a_copy_taken_from_another_thread_has_its_sum_and_counts_from_the_same_samples():
    h = Histogram(TTFT_BUCKETS)
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            h.observe(1.0)  # every sample 1.0: a consistent copy's sum is its count

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so a copy lands inside observe() if it can
    writer = threading.Thread(target=observe)
    writer.start()
    try:
        torn = 0
        for _ in range(20_000):
            copy = h.to_dict()
            torn += copy["sum"] != sum(copy["counts"])
    finally:
        stop.set()
        writer.join()
        sys.setswitchinterval(old)
    assert sum(h.counts) > 0
    assert torn == 0, f"{torn} of 20,000 copies had a sum and counts one sample apart"
