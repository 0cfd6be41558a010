#!/usr/bin/env bash
# GPU check, one script: the engine and cache tests on CUDA (float32, compared with transformers; CUDA
# graphs captured and replayed; the KV pool's fp8/bf16/fp16 round trips on the device), then the engine benchmark in bf16 (with the transformers variants on the
# same GPU, and the engine without CUDA graphs beside it), then a prefill-heavy variant of it (4,096-token
# shared prefixes, 16 output tokens), then the same on a 0.85B-parameter model with the time of each kind
# of step (bench.step_profile), then decode beside a long context (bench.mixed_decode), then a short table. About 3-4 minutes on an H200. Run from the
# repository root on a CUDA machine with torch and the engine's dependencies (transformers, tokenizers,
# safetensors, accelerate, pydantic, xxhash, llguidance, hypothesis, pytest) installed: `bash bench/gpu_check.sh`. Logs and the plot go
# to $OUT (default /tmp/gpu_check). With vllm-flash-attn importable the flash backend is used (float32
# tests then fall back to SDPA, since the kernel takes fp16/bf16 only). The tests that need a Redis
# server or Ray (the hot-prefix directory, the replica's event hand-over, the latency histograms shared with the
# deployments) are not GPU checks: left out.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export RADIXSERVE_TEST_DEVICE=${RADIXSERVE_TEST_DEVICE:-cuda} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "== device"; $PY - <<'PYEOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "transformers", transformers.__version__)
try:
    import vllm_flash_attn  # noqa: F401
    print("vllm_flash_attn: importable")
except Exception as e:  # noqa: BLE001
    print("vllm_flash_attn: missing ->", type(e).__name__, "(SDPA backend)")
# said first: a package missing here fails tests that check nothing about the device (on 2026-12-04
# llguidance, not carried, failed 12 guided-decoding tests)
import importlib
missing = []
for name in ("tokenizers", "safetensors", "accelerate", "pydantic", "xxhash", "llguidance", "hypothesis", "pytest"):
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001
        missing.append(name)
print(f"MISSING: {', '.join(missing)} (the tests that need them fail)" if missing else "the engine's packages: all import")
PYEOF
echo "== engine and cache tests on cuda"
timeout "${TESTS_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider tests/engine tests/cache \
  --ignore=tests/cache/test_directory.py --ignore=tests/cache/test_directory_cluster.py \
  --ignore=tests/cache/test_local_redis.py \
  --ignore=tests/engine/test_replica_events.py --ignore=tests/engine/test_latency_histograms.py \
  --continue-on-collection-errors >"$OUT/tests.log" 2>&1
tests_rc=$?
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
echo "== engine benchmark (bf16 on cuda, transformers on the same GPU)"
timeout "${BENCH_TIMEOUT:-300}" $PY -m bench.engine_bench --out "$OUT" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
bench_rc=$?
grep -E '^\||^###|^- |^\{|failed|^bench model|^greedy' "$OUT/bench.log"
echo "== prefill-heavy: 4,096-token shared prefixes, 16 output tokens, engine only"
mkdir -p "$OUT/long"
timeout "${LONG_TIMEOUT:-200}" $PY -m bench.engine_bench --skip-hf --system-len 4096 --output-len 16 \
  --out "$OUT/long" ${BENCH_ARGS:-} >"$OUT/bench_long.log" 2>&1
bench_long_rc=$?
grep -E '^\||^###|^- |^\{' "$OUT/bench_long.log"
echo "== a 0.85B-parameter model (bench-1b), engine only; then where each kind of step's time goes"
timeout "${BIG_TIMEOUT:-200}" bash -c "$PY -c \"from engine.model_init import write_model; write_model('/tmp/bench-1b', 'bench-1b')\" \
  && mkdir -p '$OUT/1b' && $PY -m bench.engine_bench --skip-hf --model-dir /tmp/bench-1b --out '$OUT/1b' ${BENCH_ARGS:-} \
  && $PY -m bench.step_profile --model-dir /tmp/bench-1b --profile-steps 0" >"$OUT/bench_1b.log" 2>&1
bench_1b_rc=$?
grep -E '^\||^###|^- |^\{' "$OUT/bench_1b.log"
echo "== decode beside a long context: rows padded to the longest, against chunks of like lengths"
timeout "${MIXED_TIMEOUT:-150}" $PY -m bench.mixed_decode --long 8000 --short 63 --out "$OUT" >"$OUT/mixed.log" 2>&1
mixed_rc=$?
grep -E '^(mixed|like)|^\{' "$OUT/mixed.log"
echo "== summary"
verdict() { [ "$1" = 0 ] && echo pass || echo "FAIL ($1$([ "$1" = 124 ] && echo ": timed out"))"; }
printf '| check | result |\n|---|---|\n| engine+cache tests on cuda | %s |\n' "$(verdict "$tests_rc")"
printf '| bench / bench_long / bench_1b / mixed ran | %s / %s / %s / %s |\n' "$(verdict "$bench_rc")" \
  "$(verdict "$bench_long_rc")" "$(verdict "$bench_1b_rc")" "$(verdict "$mixed_rc")"
for f in bench bench_long bench_1b mixed; do
  grep '^{' "$OUT/$f.log" | tail -1 | $PY -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    for k, v in json.loads(line).items():
        print(f"| {name}: {k} | {v:.3f} |" if isinstance(v, float) else f"| {name}: {k} | {v} |")' "$f"
done
# a benchmark that crashed (out of memory, a CUDA error) fails the check too, not only the tests
status=$tests_rc
for rc in "$bench_rc" "$bench_long_rc" "$bench_1b_rc" "$mixed_rc"; do [ "$rc" = 0 ] || [ "$status" != 0 ] || status=$rc; done
exit "$status"
