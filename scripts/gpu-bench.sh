#!/usr/bin/env bash
# The GPU checks and benchmarks, as one script for a session that has a CUDA device (budget: ~10 minutes).
#   1. benchmarks/kernels.py: correctness on CUDA (bf16 included), then paged decode attention time and achieved
#      bandwidth vs device copy bandwidth and vs SDPA, fp16/int8/int4 caches.
#   2. GPU suite: the kernel tests with the real Triton compiler instead of the interpreter.
#   3. A latency heat map of one worker serving a ~1.1B-parameter random Llama in bf16.
#   4. NIXL WRITE between two agents' registered VRAM buffers.
#   5. NIXL with GPU memory the way the KV transfer uses it (benchmarks/nixl_gpu.py): READ from a peer's registered
#      VRAM, a paged KV cache READ in place block by block (descriptors prepared once, no staging), and the
#      NIXL backend fed from a CUDA export (device-to-host into registered staging, READ, MAC, import).
#   6. Tensor parallelism on the GPUs (NCCL): the 1.1B model of step 3 served at TP 1 and TP 2 (and 4 when
#      there are 4 GPUs), the same short benchmark against each; skipped with a line on a one-GPU machine.
#   7. pdcluster vs vLLM on CUDA (benchmarks/vs_vllm.py, as `make bench` runs it on CPU): the 1.1B model of
#      step 3, served decode tok/s at batch 1 and 16 and TTFT at 512 and 2,048 prompt tokens, one server
#      loaded at a time in interleaved rounds. vLLM comes from PyPI (`uv pip install vllm` into a venv before
#      the session: the device has no network) named by $PDCLUSTER_VLLM_PYTHON, else
#      ~/.cache/pdcluster/vllm-gpu-venv; skipped with a line when no interpreter there imports vllm.
# Results land in ${OUT:-gpu-bench-out}/ (JSON, CSV, PNG, logs); copy the figures into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu-bench-out}
mkdir -p "$OUT"
PY=.venv/bin/python
[ -x "$PY" ] || { scripts/setup.sh python || exit 1; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

echo "== 1. kernel benchmark"
timeout 360 "$PY" -m benchmarks.kernels --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"

echo "== 2. kernel tests on the device (real Triton compiler)"
PDCLUSTER_TEST_CUDA=1 timeout 240 .venv/bin/pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -5 | tee "$OUT/kernel-tests.log"

echo "== 3. 1.1B random Llama: one worker, heat map"
MODEL="$OUT/llama-1b"
"$PY" - "$MODEL" <<'PY'
import sys
from pdcluster.worker.local.demo_model import build_demo_model
build_demo_model(sys.argv[1], hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=8, intermediate_size=5632, vocab_size=32000, dtype="bfloat16",
                 max_position_embeddings=4096)
PY
.venv/bin/pdcluster serve --model "$MODEL" --device cuda --dtype bfloat16 --port 18001 \
    --max-batch-size 32 --max-batch-tokens 8192 > "$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:18001/health >/dev/null && break; sleep 1; done
timeout 240 .venv/bin/pdcluster bench --url http://127.0.0.1:18001 --prompt-lens 128,512,2048 \
    --output-lens 16,128 --requests 16 --concurrency 8 --out "$OUT/heatmap-1b" 2>&1 | tail -12 | tee "$OUT/heatmap.log"
kill -TERM "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null
echo "== 4. NIXL: register GPU memory and WRITE it between two agents (UCX: NVLink/cuda_ipc or host staging)"
timeout 120 "$PY" - <<'PY' 2>&1 | grep -v "NIXL INFO" | tee "$OUT/nixl-gpu.log"
import time, torch
from nixl_cu12 import nixl_agent, nixl_agent_config
a, b = (nixl_agent(n, nixl_agent_config(backends=["UCX"])) for n in ("gpu-a", "gpu-b"))
for mib in (16, 256):
    src = torch.full((mib << 20,), 7, dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    ra, rb = a.register_memory(src), b.register_memory(dst)
    peer = a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), peer)
    t0 = time.perf_counter(); st = a.transfer(h)
    while st == "PROC":
        st = a.check_xfer_state(h)
    torch.cuda.synchronize(); dt = time.perf_counter() - t0
    print(f"nixl VRAM WRITE {mib} MiB: {st} {(mib << 20) / dt / 1e9:.2f} GB/s exact={bool((dst == 7).all())}")
    a.release_xfer_handle(h); a.remove_remote_agent(peer)
    a.deregister_memory(ra); b.deregister_memory(rb)
PY
echo "== 5. NIXL with VRAM descriptors: staging READ, paged cache READ in place, backend from a CUDA export"
timeout 240 "$PY" -m benchmarks.nixl_gpu --out "$OUT/nixl-gpu.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/nixl-gpu-bench.log"
echo "== 6. tensor parallelism: TP 1 vs TP N, same model and benchmark (NCCL)"
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${NGPU:-0}" -lt 2 ]; then
    echo "skipped: ${NGPU:-0} GPU(s) here, TP needs 2 or more" | tee "$OUT/tp.log"
else
    for TP in 1 2 4; do
        [ "$TP" -le "$NGPU" ] || continue
        .venv/bin/pdcluster serve --model "$MODEL" --device cuda --dtype bfloat16 --port 18002 \
            --tensor-parallel-size "$TP" --max-batch-size 32 --max-batch-tokens 8192 > "$OUT/serve-tp$TP.log" 2>&1 &
        SERVE=$!
        for _ in $(seq 240); do curl -sf http://127.0.0.1:18002/health >/dev/null && break; sleep 1; done
        echo "-- TP $TP" | tee -a "$OUT/tp.log"
        timeout 180 .venv/bin/pdcluster bench --url http://127.0.0.1:18002 --prompt-lens 512,2048 \
            --output-lens 128 --requests 16 --concurrency 8 --out "$OUT/tp$TP" 2>&1 | tail -8 | tee -a "$OUT/tp.log"
        kill -TERM "$SERVE" 2>/dev/null; wait "$SERVE" 2>/dev/null
    done
fi
echo "== 7. pdcluster vs vLLM on CUDA (one server loaded at a time, interleaved rounds)"
VLLM_PY=${PDCLUSTER_VLLM_PYTHON:-$HOME/.cache/pdcluster/vllm-gpu-venv/bin/python}
if [ -x "$VLLM_PY" ] && "$VLLM_PY" -c "import vllm" >/dev/null 2>&1; then
    PDCLUSTER_VLLM_PYTHON="$VLLM_PY" timeout 540 "$PY" -m benchmarks.vs_vllm --device cuda --rounds 3 \
        --no-disagg --model "$MODEL" --json "$OUT/vs-vllm.json" 2>&1 | tee "$OUT/vs-vllm.log"
else
    echo "skipped: no vLLM at $VLLM_PY (uv venv ~/.cache/pdcluster/vllm-gpu-venv && uv pip install vllm nixl, or set PDCLUSTER_VLLM_PYTHON)" | tee "$OUT/vs-vllm.log"
fi
echo "== done: $OUT"
