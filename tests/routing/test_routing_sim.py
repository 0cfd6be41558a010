"""The routing simulator's baselines and a small end-to-end run of it."""

from __future__ import annotations

from bench.routing_sim import WORKLOADS, HistoryTree, Sim, SimRequest, clairvoyant_plan, group_shares, main


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


def test_the_ray_like_takes_the_least_loaded_of_all_it_chose_as_serve_does():
    """Serve probes one rank of candidates whole and takes the lowest queue (``_select_from_candidate_replicas``);
    the simulator drew two of them at random (pow2), which is not what the PrefixCacheAffinityRouter does."""
    for seed in range(20):
        sim = Sim("ray_llm", 3, capacity_blocks=64, slots=8, prefill_ms=0.25, decode_ms=5.0, report_s=1.0,
                  seed=seed, load_weight=None)
        hashes = [11, 12, 13, 14]
        for r in ("r0", "r1", "r2"):
            sim.tree.insert(r, hashes)
        for r, busy in (("r0", 5), ("r1", 3), ("r2", 1)):
            sim.replicas[r].busy = busy
        req = SimRequest(0.0, list(range(64)), hashes, 8, 0)
        assert sim.route(req) == "r2"  # all three match: the least loaded of them
        cold = SimRequest(0.0, list(range(64)), [91, 92, 93, 94], 8, 1)
        assert sim.route(cold) == "r2"  # (no match: the smallest trees, all equal here; the least loaded)
        sim.replicas["r0"].busy = sim.replicas["r1"].busy = 1
        assert sim.route(req) == "r0"  # ties: the first, as Serve's strict scan


def test_small_run_beats_pow2_and_reports_every_baseline(capsys):
    out = main(["--replicas", "4", "--requests", "400", "--cache-prompts", "8"])
    assert out["hit_rate_vs_pow2"] > 1.5  # pow2 scatters 64 prefixes over 4 caches
    for name in ("ray_llm", "sglang", "ray_llm_reports", "sglang_reports", "consistent_hash", "clairvoyant"):
        assert out[f"hit_rate_vs_{name}"] > 0 and out[f"max_mean_load_{name}"] >= 1.0
    assert out["hit_rate_over_oracle"] > 0.8
    assert "| ray_llm_reports |" in capsys.readouterr().out


def test_clairvoyant_plan_copies_hot_groups_and_fills_every_cache_evenly():
    shares = group_shares(WORKLOADS["gsp-zipf"])
    assert abs(sum(shares) - 1.0) < 1e-9 and shares[0] > 0.2  # Zipf(1.0) over 64: the hottest is ~21%
    replicas = [f"r{i}" for i in range(8)]
    plan = clairvoyant_plan(shares, replicas, slots=8)
    assert sorted(plan) == list(range(64))  # every group has a home
    assert len(plan[0]) == 3 and len(plan[1]) == 2 and len(plan[2]) == 1  # copies by share / 0.7 of a replica
    assert all(len(set(homes)) == len(homes) for homes in plan.values())  # copies on distinct replicas
    per_replica = {r: sum(r in h for h in plan.values()) for r in replicas}
    assert max(per_replica.values()) - min(per_replica.values()) <= 1  # 67 copies over 64 slots
    planned = {r: sum(shares[g] / len(h) for g, h in plan.items() if r in h) for r in replicas}
    assert max(planned.values()) < 1.1 / 8


def test_clairvoyant_plan_uniform_groups_one_copy_each():
    plan = clairvoyant_plan([1 / 8] * 8, ["a", "b"], slots=4)
    assert all(len(h) == 1 for h in plan.values())
    assert sorted(sum(r in h for h in plan.values()) for r in ("a", "b")) == [4, 4]


def test_a_replica_added_mid_run_is_loaded_by_its_time_in_the_fleet():
    """Round robin splits work evenly among the replicas live at each moment: the one added halfway did
    its share since then, and read as a 1.12 imbalance when its total was set against whole-run totals."""
    out = main(["--workload", "gsp-small", "--replicas", "4", "--requests", "800", "--add-replica-at", "0.5",
                "--policies", "ours,round_robin", "--plot", ""])
    assert out["max_mean_load_round_robin"] < 1.03
