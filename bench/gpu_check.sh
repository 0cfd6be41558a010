#!/usr/bin/env bash
# GPU check, one script: the engine tests on CUDA (float32, compared with transformers), then the
# engine benchmark in bf16, then a short table. Run from the repository root on a CUDA machine with
# torch installed: `bash bench/gpu_check.sh`. With vllm-flash-attn importable the flash backend is
# used (float32 tests then fall back to SDPA, since the kernel takes fp16/bf16 only).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export RADIXSERVE_TEST_DEVICE=cuda PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "== device"; $PY - <<'PYEOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
try:
    import vllm_flash_attn  # noqa: F401
    print("vllm_flash_attn: importable")
except Exception as e:  # noqa: BLE001
    print("vllm_flash_attn: missing ->", type(e).__name__, "(SDPA backend)")
PYEOF
echo "== engine tests on cuda"
$PY -m pytest -q tests/engine tests/cache 2>&1 | tail -5; tests_rc=${PIPESTATUS[0]}
echo "== engine benchmark (bf16 on cuda)"
$PY -m bench.engine_bench --skip-hf --out "${OUT:-/tmp}" 2>&1 | grep -E '^\||^###|^\{' | tee /tmp/gpu_bench.txt
echo "== summary"
printf '| check | result |\n|---|---|\n| engine+cache tests on cuda | %s |\n' "$([ "$tests_rc" = 0 ] && echo pass || echo FAIL)"
tail -1 /tmp/gpu_bench.txt | $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); [print(f"| {k} | {v:.3f} |") for k,v in d.items() if isinstance(v,float)]'
exit "$tests_rc"
