"""Engine benchmark: prefix caching on vs off, against what a transformers user would do.

    python -m bench.engine_bench [--quick] [--skip-hf] [--device auto] [--out docs]

Workloads ``gsp-small`` and ``no-share`` (the project's design notes) on the bench model, greedy, no EOS stop. Engine
variants run closed-loop at concurrency 8 (as a serving benchmark's ``--max-concurrency 8``); the
transformers variants are sequential ``generate``, ``generate`` reusing a copied prompt cache of each
system prompt (the transformers docs' recipe), and ``generate_batch`` with and without
``allow_block_sharing``. Everything runs in one process, one after the other, so ratios compare like
with like. Prints a markdown table, writes a PNG, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from bench import plots
from bench.workloads import Request, gsp, no_share
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_init import write_model
from engine.model_loader import LoadedModel, load_model
from engine.sequence import SamplingParams


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _result(name: str, total_s: float, outputs: list[list[int]], ttfts: list[float], prefill: int | None) -> dict:
    n_out = sum(len(o) for o in outputs)
    return {"variant": name, "total_s": total_s, "output_tokens": n_out, "tok_s": n_out / total_s,
            "ttft_p50": _pct(ttfts, 0.5), "ttft_p90": _pct(ttfts, 0.9), "prefill_tokens": prefill,
            "outputs": outputs}


# ------------------------------------------------------------------------------ our engine
def run_engine(loaded: LoadedModel, reqs: list[Request], caching: bool, concurrency: int = 8,
               graphs: bool = True) -> dict:
    cfg = EngineConfig(model_id=loaded.model_id, prefix_caching=caching, max_batch_total_tokens=65536)
    if not graphs:
        cfg.cuda_graphs = ()
    eng = LLMEngine(cfg, loaded=loaded)
    captured = eng.capture_graphs()  # as a replica does before it takes traffic (CUDA only)
    pending = list(enumerate(reqs))
    outputs: dict[int, list[int]] = {}
    started: dict[str, tuple[int, float]] = {}
    ttfts: list[float] = []
    inflight = 0
    prefill_s = decode_s = 0.0  # where the time goes: steps that computed prompt tokens, and the rest
    decode_steps, slowest = 0, 0.0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and inflight < concurrency:
            i, r = pending.pop(0)
            rid = eng.add_request(r.prompt, SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True))
            started[rid] = (i, time.perf_counter())
            outputs[i] = []
            inflight += 1
        t_step, computed = time.perf_counter(), eng.stats.prefill_tokens_computed
        events = eng.step()
        took = time.perf_counter() - t_step
        slowest = max(slowest, took)
        if eng.stats.prefill_tokens_computed != computed:
            prefill_s += took
        else:
            decode_s += took
            decode_steps += 1
        for ev in events:
            i, t_start = started[ev.request_id]
            if ev.token_id is not None:
                if not outputs[i]:
                    ttfts.append(time.perf_counter() - t_start)
                outputs[i].append(ev.token_id)
            if ev.finished:
                inflight -= 1
    total = time.perf_counter() - t0
    eng.check_invariants()
    name = "engine, prefix cache on" if caching else "engine, prefix cache off"
    if loaded.device.type == "cuda":
        name += ", CUDA graphs" if eng.runner.graphs is not None else ", no CUDA graphs"
    res = _result(name, total, [outputs[i] for i in range(len(reqs))], ttfts, eng.stats.prefill_tokens_computed)
    s = eng.kv_stats()
    res["hit_rate"] = s["prefix_hit_tokens"] / max(1, s["prefix_queries_tokens"])
    res["split"] = (f"{res['variant']}: {prefill_s:.2f} s in steps with prompt tokens, {decode_s:.2f} s in "
                    f"{decode_steps} decode-only steps ({1000 * decode_s / max(1, decode_steps):.1f} ms each); slowest step {1000 * slowest:.0f} ms")
    if eng.runner.graphs is not None:
        g = eng.runner.graphs.stats
        res["split"] += (f"; {captured} graphs captured before the run in {g.capture_s:.2f} s, {g.steps} steps "
                         f"replayed{', ' + g.disabled if g.disabled else ''}")
    return res


# ------------------------------------------------------------------------------ transformers alone
class _FirstToken:
    """A ``generate`` streamer that notes when the first generated token arrives."""

    def __init__(self):
        self.calls = 0
        self.first: float | None = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def _ids(model, prompt: list[int]) -> torch.Tensor:
    return torch.tensor([prompt], device=model.device)


def _gen_kwargs(n: int) -> dict:
    return dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


@torch.inference_mode()
def run_hf_sequential(model, reqs: list[Request]) -> dict:
    outputs, ttfts = [], []
    t0 = time.perf_counter()
    for r in reqs:
        s = _FirstToken()
        t = time.perf_counter()
        out = model.generate(_ids(model, r.prompt), streamer=s, **_gen_kwargs(r.max_new_tokens))
        ttfts.append(s.first - t)
        outputs.append(out[0, len(r.prompt):].tolist())
    return _result("HF generate, sequential", time.perf_counter() - t0, outputs, ttfts,
                   sum(len(r.prompt) for r in reqs))


@torch.inference_mode()
def run_hf_prompt_reuse(model, reqs: list[Request], system_len: int) -> dict:
    """The transformers docs' recipe: prefill each system prompt once into a DynamicCache, then
    ``generate`` each request from a deep copy of it."""
    from transformers import DynamicCache

    caches: dict[int, object] = {}
    outputs, ttfts = [], []
    prefill = 0
    t0 = time.perf_counter()
    for r in reqs:
        t = time.perf_counter()
        if r.group not in caches:
            c = DynamicCache(config=model.config)
            model(input_ids=_ids(model, r.prompt[:system_len]), past_key_values=c, use_cache=True)
            caches[r.group] = c
            prefill += system_len
        s = _FirstToken()
        out = model.generate(_ids(model, r.prompt), past_key_values=copy.deepcopy(caches[r.group]),
                             streamer=s, **_gen_kwargs(r.max_new_tokens))
        prefill += len(r.prompt) - system_len
        ttfts.append(s.first - t)
        outputs.append(out[0, len(r.prompt):].tolist())
    return _result("HF generate + copied prompt cache", time.perf_counter() - t0, outputs, ttfts, prefill)


@torch.inference_mode()
def run_hf_generate_batch(model, reqs: list[Request], sharing: bool) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(**_gen_kwargs(reqs[0].max_new_tokens), eos_token_id=None)
    # the best of a sweep on this machine (defaults were 6-10x slower on the CPU)
    cb = ContinuousBatchingConfig(allow_block_sharing=sharing, max_batch_tokens=512, page_size=16,
                                  num_blocks=8192, max_requests_per_batch=8)
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hints = WorkloadHints(max_prompt_length=max(len(r.prompt) for r in reqs),
                          max_generated_length=reqs[0].max_new_tokens, num_requests=len(reqs))
    # generate_batch's own loop, timed from the first request to the last result: its manager's set-up
    # (an 8,192-block cache) and its stop are left out, as the engine's construction is (they took about
    # 2 s of a 32 s row)
    res = {}
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cb, block=True,
                                                   timeout=5, warmup=False, workload_hints=hints) as manager:
        t0 = time.perf_counter()
        ids = manager.add_requests(inputs=[r.prompt for r in reqs], max_new_tokens=reqs[0].max_new_tokens,
                                   record_timestamps=True)
        while len(res) < len(reqs):
            o = manager.get_result(timeout=1)
            if o is not None and o.is_finished():
                res[o.request_id] = o
            elif o is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before every request finished")
        total = time.perf_counter() - t0
    outs, ttfts = [], []
    for rid in ids:
        o = res[rid]
        outs.append(list(o.generated_tokens))
        if o.timestamps:
            ttfts.append(o.timestamps[0] - o.created_time)
    name = "HF generate_batch, block sharing" if sharing else "HF generate_batch, no sharing"
    return _result(name, total, outs, ttfts, None)


def _common_prefix(outputs: list[list[int]], ref: list[list[int]]) -> float:
    """Mean number of leading tokens each output shares with its reference."""
    def same(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return sum(same(a, b) for a, b in zip(outputs, ref, strict=True)) / len(ref)


def _hf_rows(hf, reqs: list[Request], system_len: int) -> list[dict]:
    """The transformers variants; one that fails (an API this transformers lacks, a device it does not
    support) is reported and left out, so the engine's rows still come back."""
    runs = [lambda: run_hf_sequential(hf, reqs), lambda: run_hf_prompt_reuse(hf, reqs, system_len),
            lambda: run_hf_generate_batch(hf, reqs, sharing=False),
            lambda: run_hf_generate_batch(hf, reqs, sharing=True)]
    rows = []
    for run in runs:
        try:
            rows.append(run())
        except Exception as e:  # noqa: BLE001 - a benchmark row, not a service
            print(f"transformers variant failed: {type(e).__name__}: {e}")
    return rows


# ------------------------------------------------------------------------------ report
def _table(rows: list[dict], base: dict) -> str:
    lines = ["| variant | total s | output tok/s | vs engine off | TTFT p50 s | TTFT p90 s | prefill tokens |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pf = "-" if r["prefill_tokens"] is None else f"{r['prefill_tokens']:,}"
        lines.append(f"| {r['variant']} | {r['total_s']:.1f} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x"
                     f" | {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} | {pf} |")
    return "\n".join(lines)


def _plot(results: dict[str, list[dict]], path: Path, where: str) -> None:
    fig, axes = plots.subplots(1, len(results), figsize=(6 * len(results), 4.2))
    axes = [axes] if len(results) == 1 else axes
    for ax, (wl, rows) in zip(axes, results.items(), strict=True):
        names = [r["variant"].replace(", ", "\n") for r in rows]
        vals = [r["tok_s"] for r in rows]
        colors = ["tab:green" if "cache on" in r["variant"] else
                  "tab:olive" if "engine" in r["variant"] else "tab:gray" for r in rows]
        ax.barh(names, vals, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("output tokens/s (higher is better)")
        ax.set_title(f"{wl}: bench model, {where}")
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.0f}", va="center")
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=None, help="bench model folder (written if missing)")
    ap.add_argument("--quick", action="store_true", help="4 groups x 4 prompts, 256-token system prompts")
    ap.add_argument("--skip-hf", action="store_true", help="engine variants only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda; dtype follows it")
    ap.add_argument("--system-len", type=int, default=1024, help="gsp-small's shared prefix (no-share's prompts follow)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default="docs", help="folder for the PNG")
    args = ap.parse_args(argv)
    if args.quick and (args.system_len, args.output_len) != (1024, 32):
        ap.error("--quick has its own lengths: drop --system-len/--output-len, or --quick")

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir or Path.home() / ".cache" / "radixserve" / "models" / "bench")
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "bench")
    if args.quick:
        system_len, workloads = 256, {"gsp-small": gsp(4, 4, system_len=256),
                                      "no-share": no_share(16, prompt_len=256 + 64)}
    else:
        system_len, n = args.system_len, args.output_len
        tag = "" if (system_len, n) == (1024, 32) else f", {system_len}-token prefix, {n} out"
        workloads = {f"gsp-small{tag}": gsp(system_len=system_len, output_len=n),
                     f"no-share{tag}": no_share(prompt_len=system_len + 64, output_len=n)}

    loaded = load_model(str(model_dir), device=args.device)
    where = (f"{torch.cuda.get_device_name(loaded.device)}, {str(loaded.dtype).removeprefix('torch.')}"
             if loaded.device.type == "cuda" else f"CPU, {args.threads} threads")
    print(f"bench model on {where}")
    hf = None
    if not args.skip_hf:  # transformers alone, on the engine's device and dtype
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=loaded.dtype, use_kernels=False)
        hf = hf.to(loaded.device).eval()
    run_engine(loaded, gsp(1, 2, system_len=64, question_len=16, output_len=4), True)  # warm-up, untimed
    results: dict[str, list[dict]] = {}
    for wl, reqs in workloads.items():
        rows = [run_engine(loaded, reqs, True), run_engine(loaded, reqs, False)]
        if loaded.device.type == "cuda":  # what the graphs bring, side by side
            rows.append(run_engine(loaded, reqs, True, graphs=False))
        if hf is not None and wl.startswith("gsp"):
            rows += _hf_rows(hf, reqs, system_len)
        results[wl] = rows
        print(f"\n### {wl} ({len(reqs)} requests)\n")
        print(_table(rows, rows[1]))
        print("\n" + "\n".join(f"- {r['split']}" for r in rows if "split" in r))
    gsp_rows, noshare_rows = results.values()
    on, off = gsp_rows[0], gsp_rows[1]
    ns_on, ns_off = noshare_rows[0], noshare_rows[1]
    hf_rows = [r for r in gsp_rows if "split" not in r]  # the engine's rows say where their time went
    summary = {
        "cache_on_vs_off_throughput": on["tok_s"] / off["tok_s"],
        "noshare_on_vs_off_throughput": ns_on["tok_s"] / ns_off["tok_s"],
        "ttft_p50_on_vs_off": on["ttft_p50"] / off["ttft_p50"],
        "prefill_tokens_on_vs_off": on["prefill_tokens"] / off["prefill_tokens"],
        "gsp_hit_rate": on["hit_rate"],
        "engine_on_tok_s": on["tok_s"],
    }
    if len(gsp_rows) > 2 and "no CUDA graphs" in gsp_rows[2]["variant"]:
        summary["cuda_graphs_on_vs_off_throughput"] = on["tok_s"] / gsp_rows[2]["tok_s"]
        summary["noshare_cuda_graphs_on_vs_off_throughput"] = ns_on["tok_s"] / noshare_rows[2]["tok_s"]
    if hf_rows:
        best = max(hf_rows, key=lambda r: r["tok_s"])
        ref = next((r for r in hf_rows if "sequential" in r["variant"]), hf_rows[0])["outputs"]  # the reference
        same = sum(a == b for a, b in zip(on["outputs"], ref, strict=True))
        summary.update({"vs_hf_best_throughput": on["tok_s"] / best["tok_s"], "hf_best_variant": best["variant"],
                        "greedy_match_hf": same == len(ref), "greedy_match_hf_fraction": same / len(ref),
                        # tokens before the first difference: in bf16, rounding alone makes greedy paths part
                        # (the same figure between transformers' own variants shows how much)
                        "greedy_common_prefix_vs_hf": _common_prefix(on["outputs"], ref)})
        for r in hf_rows:
            if r["outputs"] is not ref:
                print(f"greedy common prefix, {r['variant']} vs sequential: {_common_prefix(r['outputs'], ref):.1f}")
    _plot(results, Path(args.out) / "engine_bench.png", where)  # plots.save makes the folder
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
