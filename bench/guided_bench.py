"""What structured outputs cost: the same requests with and without a guide, side by side in one run.

Eight requests decode together on the bench model (57M parameters, a 32k vocabulary), sampled, once
free and once held to a JSON schema no answer can complete within max_tokens (a list of at least 100
digits), so both runs keep every row to the end and generate the same number of tokens. Runs
alternate, so the machine's drift hits both; the guided run pays for a mask a row a step (llguidance's,
unpacked in ``engine.guided.mask_disallowed``) and for the sampler's per-row path. ``--regex`` holds the
rows to a regular expression instead (``(a{200}){200}``: every mask near llguidance's limits), and a third
run computes the step's masks one after another rather than on llguidance's threads.

    python -m bench.guided_bench [--rows 8] [--tokens 64] [--repeats 3] [--regex '(a{200}){200}']
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine import guided
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_init import write_model
from engine.model_loader import load_model
from engine.sequence import SamplingParams

SCHEMA = {"type": "array", "minItems": 100, "items": {"type": "integer", "minimum": 0, "maximum": 9}}


def run(engine: LLMEngine, rows: int, tokens: int, guided: bool, regex: str | None = None) -> tuple[float, int]:
    """(seconds, tokens generated) of one batch."""
    guide = (("regex", regex) if regex else ("json", json.dumps(SCHEMA))) if guided else None
    params = [SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True, guide=guide)
              for i in range(rows)]
    prompts = [[(i * 7 + k) % 250 + 3 for k in range(64)] for i in range(rows)]
    start = time.perf_counter()
    seqs = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(s.output_ids) for s in seqs)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", default=None, help="default: ~/.cache/radixserve/models/bench (written if missing)")
    ap.add_argument("--regex", default=None, help="hold the rows to this regular expression instead of the schema")
    args = ap.parse_args(argv)
    model_dir = Path(args.model_dir or Path.home() / ".cache" / "radixserve" / "models" / "bench")
    if not (model_dir / "config.json").exists():
        write_model(model_dir, "bench")
    engine = LLMEngine(EngineConfig(model_id=str(model_dir), max_batch_total_tokens=8192, prefix_caching=False),
                       loaded=load_model(str(model_dir)))
    run(engine, args.rows, 4, True, args.regex)  # warm-up: the kernels, the first guide's compilation
    totals = {"free": [0.0, 0], "guided": [0.0, 0], **({"guided_serial": [0.0, 0]} if args.regex else {})}
    for _ in range(args.repeats):
        for kind in totals:
            guided.PARALLEL_MASKS = kind != "guided_serial"
            s, n = run(engine, args.rows, args.tokens, kind != "free", args.regex)
            totals[kind][0] += s
            totals[kind][1] += n
    guided.PARALLEL_MASKS = True
    rates = {k: n / s for k, (s, n) in totals.items()}
    out = {"rows": args.rows, "tokens": args.tokens, "free_tok_s": round(rates["free"], 1),
           "guided_tok_s": round(rates["guided"], 1), "guided_over_free": round(rates["guided"] / rates["free"], 3),
           "guided_tokens": totals["guided"][1], "free_tokens": totals["free"][1]}
    if args.regex:
        out["guided_serial_tok_s"] = round(rates["guided_serial"], 1)
        out["parallel_over_serial_masks"] = round(rates["guided"] / rates["guided_serial"], 3)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
