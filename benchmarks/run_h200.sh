#!/usr/bin/env bash
# The GPU checks and benchmarks of issues 4 and 5 on the lent H200, in parts that fit one device
# call (< 10 min each):
#   bash benchmarks/run_h200.sh ours    # jaxinfer bench: B=1 ctx 128+256, B=64 ctx 2k, B=1 ctx 32k
#   bash benchmarks/run_h200.sh peer    # HF transformers (static cache), B=1 ctx 128+256, then
#                                       # the table of ours / peer when ours ran first
#   bash benchmarks/run_h200.sh tests   # GPU-marked tests (kernels vs references, greedy tokens)
#   bash benchmarks/run_h200.sh profile # per-kernel time of the B=1 decode step (and unfused)
#   bash benchmarks/run_h200.sh kernels # benchmarks/kernels.py, parts from $KERNELS (decode
#                                       # shapes from $DECODE_SHAPES, e.g. 8x8192,1x32768)
#   bash benchmarks/run_h200.sh sweep   # the B=1 step profiled under several matmul block sizes
#   bash benchmarks/run_h200.sh prefetch # the L2 prefetch: default, off, instructions left out
#   bash benchmarks/run_h200.sh pdl     # does PDL overlap kernels under XLA? (session 4: no)
#   bash benchmarks/run_h200.sh pdlffi  # PDL through our own FFI launch (session 9: honoured)
#   bash benchmarks/run_h200.sh layout  # decode GEMVs with the weights stored [K, N] vs [N, K]
#   bash benchmarks/run_h200.sh steps   # decode steps per host check of the device loop
#   bash benchmarks/run_h200.sh gridbar # is a grid barrier in a persistent kernel cheaper than
#                                       # a kernel boundary? (grid_barrier_probe.py, ~1 min)
#   bash benchmarks/run_h200.sh persist # the same in Mosaic GPU, the weight ring running through
#                                       # the barrier (persistent_mgpu_probe.py, ~2 min)
#   bash benchmarks/run_h200.sh inject  # a Triton-source GEMV vs the same in Pallas, both
#                                       # compiled and launched by XLA (ttir_inject_probe.py)
#   bash benchmarks/run_h200.sh ffistep # the B=1 step with its Pallas kernels launched by our FFI
#                                       # call, with and without PDL (ffi_step_probe.py)
#   bash benchmarks/run_h200.sh mlp     # the one-kernel MLP (swiglu_down) vs SwiGLU + down
# Results: JSON lines in ${OUT:-.}/bench-<part>.jsonl; a table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
ours() {
  for args in "--batch 1 --prompt-len 128 --gen-len 256 --dump-hlo $out/decode" \
              "--batch 64 --prompt-len 2048 --gen-len 64 --repeats 2" \
              "--batch 1 --prompt-len 32768 --gen-len 64 --repeats 2"; do
    timeout 200 python3 benchmarks/decode.py --preset llama3-8b --random-weights $args --json \
      2> >(grep -v '^bench' | tail -5 >&2) | tee -a "$out/bench-ours.jsonl"
  done
}
peer() {
  timeout 240 python3 -P benchmarks/peer_hf.py --preset llama3-8b --batch 1 --prompt-len 128 \
    --gen-len 256 --repeats 2 | tee -a "$out/bench-peer.jsonl"
  if [ -s "$out/bench-ours.jsonl" ]; then table; fi
}
table() {  # ours beside the peer (the issue-5 table), from this run's JSON lines
  python3 benchmarks/compare_peer.py "$out/bench-ours.jsonl" "$out/bench-peer.jsonl"
}
tests() {
  timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gpu.py tests/test_kernels.py tests/test_norm_matmul.py \
    tests/test_decode_attention_append.py tests/test_kernel_wiring.py \
    tests/test_decode_matmul_mgpu.py tests/test_l2_prefetch.py 2>&1 | tail -15
}
profile() {  # where the B=1 decode step's time goes, fused kernels vs the older path
  for v in "" "--unfused"; do
    timeout 150 python3 benchmarks/profile_decode.py --preset llama3-8b --batch 1 \
      --prompt-len 128 --steps 32 $v --json "$out/profile${v:+-unfused}.json" 2>&1 | tail -45
  done
}
sweep() {  # the B=1 step profiled under several configurations ($SWEEP: one per line)
  local q=4096,6144,1 o=4096,4096,1 gu=4096,14336,2 dn=14336,4096,1
  local blocks="{\"$q\":[16,64,256,4,3,2],\"$o\":[16,64,256,4,3,2],\"$gu\":[16,128,128,4,3,1],\"$dn\":[16,256,64,4,4,8]}"
  local configs=${SWEEP:-"
--boundaries kernel
--boundaries swiglu
--blocks {\"$o\":[16,64,256,4,3,2]}
--blocks {\"$dn\":[16,64,256,4,3,2]}
--unfused
--blocks $blocks"}
  while IFS= read -r cfg; do
    echo "== $cfg"
    # shellcheck disable=SC2086
    timeout 100 python3 benchmarks/profile_decode.py --preset llama3-8b --batch 1 --prompt-len 128 \
      --steps 32 --top 12 $cfg 2>&1 | grep -v "^bench" | tail -15
  done <<< "$configs"
}
prefetch() {  # the L2 prefetch: default, off, instructions left out, page touches (NOTES run L)
  SWEEP='--top 6
--top 6 --prefetch {"down":null,"qkv":null}
--top 6 --prefetch {"insn":"none"}
--top 6
--top 6 --prefetch {"down":null,"qkv":null}
--top 6 --prefetch {"insn":"none"}
--top 6 --prefetch {"pages":{"o":"end","mlp":"start","down":"start","qkv":"start"}}
--top 6 --prefetch {"pages":{"o":"end","mlp":"end","down":"end","qkv":"end"}}' sweep
}
kernels() {  # KERNELS="gemv,decode" picks parts of benchmarks/kernels.py
  timeout "${KERNELS_TIMEOUT:-300}" python3 benchmarks/kernels.py --only "${KERNELS:-gemv}" \
    ${DECODE_SHAPES:+--decode-shapes "$DECODE_SHAPES"} \
    ${FLASH_HEAD_DIMS:+--flash-head-dims "$FLASH_HEAD_DIMS"} --json "$out/kernels.json" 2>&1 \
    | tail -"${KERNELS_TAIL:-60}"
}
pdl() {  # chains of decode matmuls: Mosaic with and without PDL, our Triton kernel, XLA
  timeout "${PDL_TIMEOUT:-300}" python3 benchmarks/pdl_probe.py ${PDL_ARGS:-} --json "$out/pdl.json"
  echo "== XLA command buffers off"  # do CUDA graphs drop the PDL launch attribute?
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "${PDL_TIMEOUT:-300}" \
    python3 benchmarks/pdl_probe.py ${PDL_ARGS:-} --json "$out/pdl-nocmdbuf.json"
}
pdlffi() {  # our own PDL launch path (an XLA FFI call) vs XLA's, and Triton's launcher (torch)
  timeout "${PDL_TIMEOUT:-300}" python3 benchmarks/pdl_ffi_probe.py --source-kernel \
    ${PDLFFI_ARGS:-} --json "$out/pdlffi.json"
  timeout "${PDL_TIMEOUT:-300}" python3 benchmarks/pdl_launch_probe.py --json "$out/pdltorch.json"
}
layout() {  # benchmarks/layout_probe.py: weight layout x tile shape, per decode shape
  timeout "${LAYOUT_TIMEOUT:-240}" python3 benchmarks/layout_probe.py ${LAYOUT_ARGS:-} \
    --json "$out/layout.json" 2>&1 | grep -v "^WARNING"
}
steps() {  # benchmarks/sync_probe.py: generate.STEPS_PER_SYNC candidates, alternating
  timeout "${SYNC_TIMEOUT:-300}" python3 benchmarks/sync_probe.py --preset llama3-8b \
    ${SYNC_ARGS:---ks 1,3,5} | tee -a "$out/bench-sync.jsonl"
}
gridbar() {
  timeout "${GRIDBAR_TIMEOUT:-240}" python3 benchmarks/grid_barrier_probe.py ${GRIDBAR_ARGS:-} \
    --json "$out/gridbar.json"
}
persist() {
  timeout "${PERSIST_TIMEOUT:-300}" python3 benchmarks/persistent_mgpu_probe.py ${PERSIST_ARGS:-} \
    --json "$out/persist.json"
}
inject() {
  timeout "${INJECT_TIMEOUT:-300}" python3 benchmarks/ttir_inject_probe.py ${INJECT_ARGS:-} \
    --dump "$out/src" --json "$out/inject.json" 2>&1 | grep -v "^WARNING"
}
ffistep() {
  timeout "${FFISTEP_TIMEOUT:-560}" python3 benchmarks/ffi_step_probe.py ${FFISTEP_ARGS:-} \
    --json "$out/ffistep.json" 2>&1 | grep -v -E "^WARNING|DeprecationWarning|deprecations.warn"
}
mlp() {  # the one-kernel MLP (swiglu_down) against SwiGLU + down, profiled B=1 steps ($MLP:
  # one --mlp JSON per line, see profile_decode.py), after its GPU tests
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_norm_matmul.py \
    -k swiglu_down 2>&1 | grep -E "^E |passed|failed" | head -20
  local configs=${MLP:-'{"rows": 1}
{"rows": 0}
{"rows": 1, "stagger": false}
{"rows": 1}
{"rows": 0}
{"rows": 1, "block_d": 128}'}
  while IFS= read -r cfg; do
    echo "== $cfg"
    timeout 100 python3 benchmarks/profile_decode.py --preset llama3-8b --batch "${MLP_BATCH:-1}" \
      --prompt-len 128 --steps 32 --top "${MLP_TOP:-8}" --mlp "$cfg" 2>&1 | grep -v "^bench" | tail -11
  done <<< "$configs"
}
for part in "${@:-ours}"; do "$part"; done
