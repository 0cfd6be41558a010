"""The routing simulator's baselines and a small end-to-end run of it."""

from __future__ import annotations

from bench.routing_sim import HistoryTree, main


def test_history_tree_remembers_every_route_and_never_hears_of_evictions():
    t = HistoryTree()
    for r in ("a", "b"):
        t.add(r)
    t.insert("a", [1, 2, 3])
    t.insert("b", [1, 2, 9])
    t.insert("a", [1, 2, 3])  # routed again: the tenant does not grow
    assert t.match([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert t.match([7]) == {}
    assert t.size == {"a": 3, "b": 3}
    t.remove("a")
    assert t.match([1, 2, 3]) == {"b": 2}


def test_small_run_beats_pow2_and_reports_every_baseline(capsys):
    out = main(["--replicas", "4", "--requests", "400", "--cache-prompts", "8"])
    assert out["hit_rate_vs_pow2"] > 1.5  # pow2 scatters 64 prefixes over 4 caches
    for name in ("ray_llm", "sglang", "ray_llm_reports", "sglang_reports", "consistent_hash"):
        assert out[f"hit_rate_vs_{name}"] > 0 and out[f"max_mean_load_{name}"] >= 1.0
    assert out["hit_rate_over_oracle"] > 0.8
    assert "| ray_llm_reports |" in capsys.readouterr().out
