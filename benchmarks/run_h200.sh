#!/usr/bin/env bash
# The GPU checks and benchmarks on the lent H200, in parts that each fit one device call:
#   bash benchmarks/run_h200.sh ours     # jaxinfer bench: B=1 ctx 128+256, B=64 ctx 2k, B=1 ctx 32k
#   bash benchmarks/run_h200.sh peer     # HF transformers (static cache), B=1 ctx 128+256, then
#                                        # the table of ours / peer when ours ran first
#   bash benchmarks/run_h200.sh old      # the previous main (a checkout in .old/) beside this one:
#                                        # B=1 and B=64 ($CONFIGS), alternating old / new,
#                                        # $ROUNDS (2) times
#   bash benchmarks/run_h200.sh det      # KernelPolicy.deterministic(): its B=1 cost beside the
#                                        # default, then determinism.py (3 runs bitwise; a row
#                                        # alone vs in batches of 4/16 (generate) and 16/64/256
#                                        # (one step, 4 layers); chunked prefill; ms/step B=1, 64)
#   bash benchmarks/run_h200.sh tests    # every GPU-marked test, in four parts of < 6 min each
#   bash benchmarks/run_h200.sh tests1   # (or one part: tests1 flash, tests2 decode kernels,
#                                        #  tests3 the model, tests4 quantized weights and cache)
#   bash benchmarks/run_h200.sh profile  # per-kernel time of the B=1 decode step ($PROFILE_ARGS:
#                                        # more profile_decode.py options, e.g. --model FILE;
#                                        # $PROFILE_TIMEOUT, $PROFILE_TAIL: its limit, lines)
#   bash benchmarks/run_h200.sh sweep    # the B=1 step profiled under several policies ($SWEEP)
#   bash benchmarks/run_h200.sh kernels  # benchmarks/kernels.py, parts from $KERNELS
#   bash benchmarks/run_h200.sh kv       # benchmarks/kv_cache.py: bf16 / int8 / fp8 KV cache at
#                                        # B=1 ctx 32k, and the embedded model's int8 tokens
#                                        # ($KV_ARGS: e.g. --skip greedy where it is absent)
#   bash benchmarks/run_h200.sh quant    # jaxinfer bench, bf16 vs int8 vs int4 weights
#   bash benchmarks/run_h200.sh qkernels # benchmarks/quantized.py (quantized decode matmuls; $QK_ARGS:
#                                        # more options, e.g. --only mosaic --configs ...)
#   bash benchmarks/run_h200.sh q37      # issue 37's B=1 ratios in one call: jaxinfer bench in
#                                        # bf16, int4, int8 ($Q37: formats), the gpt-fast int4
#                                        # peer, then each format's speed-up over bf16 and int4's
#                                        # over the peer (~6 min)
#   bash benchmarks/run_h200.sh int4order # benchmarks/int4_order.py: int4 codes in K order vs
#                                        # fragment order end to end, B=1, beside bf16
#   bash benchmarks/run_h200.sh ncuquant # Nsight Compute on the Mosaic int4 kernel alone
#                                        # (benchmarks/ncu_quant.py): occupancy, its limiters,
#                                        # stall reasons; $NCU_ARGS: e.g. --configs 2-4-4,2-4-4f
#   bash benchmarks/run_h200.sh head     # benchmarks/head_selfdistill.py: an EAGLE head trained on
#                                        # the model's own answers, then its acceptance beside
#                                        # n-gram (HEAD_MODEL=the embedded GGUF, carried in)
#   bash benchmarks/run_h200.sh specfall # benchmarks/spec_fallback.py: plain greedy vs a random head
#                                        # (drafts never accepted) with and without the fallback
#                                        # to plain rounds, and n-gram ($SPECFALL_ARGS)
#   bash benchmarks/run_h200.sh ggufmix  # a random Llama-3-8B-shaped GGUF in $GGUF_TYPES (q4_k_m)
#                                        # through the real loader, B=1 128 + 256, beside bf16
#                                        # (needs the gguf wheel: carry it, README of the tool)
#   bash benchmarks/run_h200.sh moe      # benchmarks/moe.py: MoE experts, our Pallas kernels vs
#                                        # ragged_dot vs a dense per-expert loop vs gather
#                                        # (Mixtral, Qwen3-30B-A3B; $MOE_ARGS: e.g. --tokens ...;
#                                        #  --quant int8,int4: the kernels on quantized experts
#                                        #  at the decode shapes, pallas_{decode,grouped}_int4)
#   bash benchmarks/run_h200.sh deepseek # jaxinfer bench at DeepSeek-V2-Lite and Qwen3-30B-A3B
#                                        # shapes (random weights): B=1 and B=32 decode
#   bash benchmarks/run_h200.sh route    # the MoE router: XLA's ops, one program a row, D in
#                                        # 16 blocks (the default), with the boundary in its
#                                        # kernel or not, alternated: Mixtral int4 (and bf16
#                                        # where it fits), Qwen3-30B-A3B int4; its GPU tests
#                                        # ($ROUTE_VARIANTS: "rows,boundary,blocks" triples)
#   bash benchmarks/run_h200.sh gemma    # benchmarks/gemma_attention.py (soft-capped flash and
#                                        # decode attention at D256 vs XLA / cuDNN), then
#                                        # jaxinfer bench --preset gemma3-27b and gemma3-1b, B=1
#   bash benchmarks/run_h200.sh multi    # 2+ GPUs (nvidia-h200-x2): llama3-8b tp 1 vs tp 2 at B=1
#                                        # and B=64, llama3-70b tp 2 at B=1 and 32, mixtral ep 1
#                                        # vs ep 2 at B=1 and 32, then the 2-GPU test
#                                        # ($MULTI: a subset of multi8b multi70b multiep)
#   bash benchmarks/run_h200.sh mla      # benchmarks/mla.py: MLA decode attention (DeepSeek-V2-Lite
#                                        # shapes, $MLA_SHAPES; $MLA_ARGS: e.g. --kinds int8,fp8
#                                        # or --tune --kinds bf16) vs XLA absorbed / expanded,
#                                        # then the GPU tests of tests/test_mla.py
#   bash benchmarks/run_h200.sh paged    # benchmarks/paged_attention.py: paged decode attention
#                                        # (pages 16/32/64, tilings) vs JAX's bundled Pallas paged
#                                        # kernel vs our contiguous kernel, B=64 ragged 1k-16k;
#                                        # the fused paged append at B=64 ctx 2k ($PAGED_ARGS:
#                                        # e.g. --quick); then tests/test_paged_attention.py -m gpu
# Results: JSON lines in ${OUT:-.}/bench-<part>.jsonl; a table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-.}
# The machine lacks some of our packages (gguf, the server's): wheels carried in .whl (the
# device tool's README says how) are installed outside the checkout and put on the path.
site=
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && site=:/tmp/site && export PYTHONPATH=.$site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
bench() {  # bench ROOT LABEL ARGS...: benchmarks/decode.py of the checkout at ROOT
  local root=$1 label=$2
  shift 2
  PYTHONPATH=$root$site timeout 200 python3 "$root/benchmarks/decode.py" --preset llama3-8b \
    --random-weights --json "$@" 2> >(grep -v '^bench' | tail -5 >&2) \
    | sed "s/^{/{\"checkout\": \"$label\", /" | tee -a "$out/bench-$label.jsonl"
}
B1="--batch 1 --prompt-len 128 --gen-len 256"
B64="--batch 64 --prompt-len 2048 --gen-len 64 --repeats 2"
ours() {
  bench . ours $B1 --dump-hlo "$out/decode"
  bench . ours $B64
  bench . ours --batch 1 --prompt-len 32768 --gen-len 64 --repeats 2
}
peer() {
  timeout 240 python3 -P benchmarks/peer_hf.py --preset llama3-8b --batch 1 --prompt-len 128 \
    --gen-len 256 --repeats 2 | tee -a "$out/bench-peer.jsonl"
  if [ -s "$out/bench-ours.jsonl" ]; then
    python3 benchmarks/compare_peer.py "$out/bench-ours.jsonl" "$out/bench-peer.jsonl"
  fi
}
old() {  # the previous main, checked out in .old/ (an ignored folder carried to the machine)
  [ -d .old ] || { echo "no .old/ checkout" >&2; return 1; }
  for _ in $(seq "${ROUNDS:-2}"); do
    for cfg in ${CONFIGS:-B1 B64}; do
      # shellcheck disable=SC2086
      bench .old old ${!cfg}
      # shellcheck disable=SC2086
      bench . new ${!cfg}
    done
  done
  python3 benchmarks/compare_peer.py "$out/bench-new.jsonl" "$out/bench-old.jsonl"
}
det() {
  for _ in $(seq "${ROUNDS:-2}"); do
    # shellcheck disable=SC2086
    bench . default $B1 --policy default
    # shellcheck disable=SC2086
    bench . deterministic $B1 --policy deterministic
  done
  python3 benchmarks/compare_peer.py "$out/bench-deterministic.jsonl" "$out/bench-default.jsonl"
  timeout "${DET_TIMEOUT:-540}" python3 benchmarks/determinism.py --preset llama3-8b \
    --policies "${DET_POLICIES:-default,deterministic}" --checks generate \
    --json "$out/determinism.json"
  timeout "${DET_TIMEOUT:-540}" python3 benchmarks/determinism.py --preset llama3-8b \
    --layers 4 --policies "${DET_POLICIES:-default,deterministic}" --checks rows,chunks,probe \
    --json "$out/determinism-rows.json"
  timeout "${DET_TIMEOUT:-540}" python3 benchmarks/determinism.py --preset llama3-8b \
    --policies "${DET_POLICIES:-default,deterministic}" --checks time \
    --json "$out/determinism-time.json"
}
gpu_tests() {
  timeout "${TESTS_TIMEOUT:-350}" python3 -m pytest -q -m gpu -p no:cacheprovider "$@" 2>&1 \
    | tail -15
}
tests1() { gpu_tests tests/test_kernels.py; }
tests2() {
  gpu_tests tests/test_norm_matmul.py tests/test_decode_attention_append.py \
    tests/test_l2_prefetch.py
}
tests3() {
  gpu_tests tests/test_gpu.py tests/test_kernel_wiring.py tests/test_determinism.py
}
tests4() { gpu_tests tests/test_quantized.py tests/test_quantized_mgpu.py tests/test_kv_cache_quant.py; }
tests() { tests1; tests2; tests3; tests4; }
profile() {  # where the B=1 decode step's time goes
  timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/profile_decode.py --preset llama3-8b \
    --batch 1 --prompt-len 128 --steps 32 ${PROFILE_ARGS:-} --json "$out/profile.json" 2>&1 \
    | tail -"${PROFILE_TAIL:-45}"
}
sweep() {  # the B=1 step profiled under several configurations ($SWEEP: one per line)
  local configs=${SWEEP:-"
--boundaries kernel,kernel,kernel
--mlp-rows 0
--lm-head pallas
--policy deterministic"}
  while IFS= read -r cfg; do
    echo "== $cfg"
    # shellcheck disable=SC2086
    timeout 100 python3 benchmarks/profile_decode.py --preset llama3-8b --batch 1 --prompt-len 128 \
      --steps 32 --top 12 $cfg 2>&1 | grep -v "^bench" | tail -15
  done <<< "$configs"
}
quant() {  # jaxinfer bench with bf16 and quantized weights in one call ($QUANT: formats)
  for q in ${QUANT:-none int8 int4}; do
    for cfg in ${CONFIGS:-B1 B64}; do
      # shellcheck disable=SC2086
      bench . "w-$q" ${!cfg} --quantization "$q"
    done
  done
}
head() {  # self-distilled EAGLE head for $HEAD_MODEL (a path: the machine cannot download)
  timeout "${HEAD_TIMEOUT:-500}" python3 benchmarks/head_selfdistill.py --model "$HEAD_MODEL" \
    --out /tmp/head.safetensors --json "$out/head.json" ${HEAD_ARGS:-} 2>&1 | grep -v '^I'
}
int4order() {  # KernelPolicy.int4_fragment_order end to end (the same tokens either way)
  timeout "${INT4ORDER_TIMEOUT:-400}" python3 benchmarks/int4_order.py ${INT4ORDER_ARGS:-} 2>&1 \
    | grep -v '^I' | tee "$out/int4_order.txt" | grep -v '^{'
}
specfall() {  # what rejected drafts cost (Llama-3-8B shapes, random weights and head)
  timeout "${SPECFALL_TIMEOUT:-300}" python3 benchmarks/spec_fallback.py ${SPECFALL_ARGS:-} \
    --json 2>&1 | grep -v '^I' | tee "$out/spec_fallback.txt" | grep -v '^{'
}
ggufmix() {  # benchmarks/random_gguf.py's file through `jaxinfer bench --model`, then bf16
  for t in ${GGUF_TYPES:-q4_k_m}; do
    python3 benchmarks/random_gguf.py "/tmp/l8-$t.gguf" --shapes llama3-8b --types "$t" &&
      timeout 200 python3 benchmarks/decode.py --model "/tmp/l8-$t.gguf" $B1 --json \
        2> >(grep -v '^bench' | tail -5 >&2) | sed "s/^{/{\"checkout\": \"gguf-$t\", /" \
        | tee -a "$out/bench-gguf.jsonl"
    rm -f "/tmp/l8-$t.gguf"
  done
  bench . w-none $B1
}
q37() {  # ours in bf16 and quantized, the gpt-fast-style tinygemm peer, then the ratios
  for q in none ${Q37:-int4 int8}; do
    # shellcheck disable=SC2086
    bench . "q37-$q" $B1 --quantization "$q"
  done
  timeout 300 python3 benchmarks/peer_gptfast.py --preset llama3-8b --quant int4 --batch 1 \
    --prompt-len 128 --gen-len 256 2> >(tail -5 >&2) | grep '^{' | tee "$out/bench-q37-peer.jsonl"
  python3 - "$out" <<'PY'
import glob, json, sys
rows = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/bench-q37-*.jsonl")):
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            rows[path.rsplit("q37-", 1)[1][:-6]] = r["decode_ms_per_token"]
bf16, peer = rows.get("none"), rows.get("peer")
for name, ms in rows.items():
    vs = f"  {bf16 / ms:.2f}x bf16" if bf16 else ""
    vp = f"  {peer / ms:.2f}x the int4 peer" if peer and name == "int4" else ""
    print(f"{name:6s} {ms:7.3f} ms/token{vs}{vp}")
PY
}
qkernels() {  # benchmarks/quantized.py: the quantized decode matmuls vs the bf16 kernel
  # shellcheck disable=SC2086
  timeout "${KERNELS_TIMEOUT:-400}" python3 benchmarks/quantized.py ${QUICK:+--quick} \
    ${QK_ARGS:-} --json "$out/quantized.json" 2>&1 | grep -v '^{' | tail -"${KERNELS_TAIL:-70}"
}
ncuquant() {  # the int4 kernel's occupancy, stalls, instruction mix (only the Mosaic kernels:
  # each takes 18+ replay passes, ~1 min a kernel with memory saved; counters on Firecracker only);
  # MOSAIC_GPU_DUMP_PTXAS: ptxas's registers and spills per kernel, printed at compile time
  MOSAIC_GPU_DUMP_PTXAS=1 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout "${NCU_TIMEOUT:-400}" ncu \
    --profile-from-start off --clock-control none --kernel-name regex:mosaic \
    --section LaunchStats --section Occupancy --section SpeedOfLight --section WarpStateStats \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
    --section MemoryWorkloadAnalysis python3 benchmarks/ncu_quant.py ${NCU_ARGS:-} 2>&1 \
    | tee "$out/ncu.txt" | grep -E '^(ok|FAIL|skip|profiled)|^  [a-z_]|ptxas info|Used [0-9]+ registers|Block Limit|Registers|Achieved Occ|Theoretical Occ|Duration|Memory Throughput|DRAM Throughput|Stall|Warp Cycles|Issued Warp|No Eligible|Shared Memory Config|Dynamic Shared|Executed Ipc|Issue Slots|Executed Instructions|SM Busy|Pipe' \
    | command head -"${NCU_TAIL:-400}"  # `head` here is the part below
}
kernels() {  # KERNELS="gemv,decode" picks parts of benchmarks/kernels.py
  timeout "${KERNELS_TIMEOUT:-300}" python3 benchmarks/kernels.py --only "${KERNELS:-gemv}" \
    ${DECODE_SHAPES:+--decode-shapes "$DECODE_SHAPES"} \
    ${FLASH_HEAD_DIMS:+--flash-head-dims "$FLASH_HEAD_DIMS"} --json "$out/kernels.json" 2>&1 \
    | tail -"${KERNELS_TAIL:-60}"
}
kv() {  # the quantized KV caches: speed and bytes at 32k, then fidelity on the embedded model
  timeout "${KV_TIMEOUT:-540}" python3 benchmarks/kv_cache.py ${KV_ARGS:-} --json "$out/kv_cache.jsonl" 2>&1 \
    | grep -v '^bench' | tail -20
}
moe() {  # benchmarks/moe.py: the MoE experts' implementations at prefill and decode shapes
  timeout "${MOE_TIMEOUT:-300}" python3 benchmarks/moe.py ${QUICK:+--quick} ${MOE_ARGS:-} \
    ${MOE_MODELS:+--models "$MOE_MODELS"} --json "$out/moe${MOE_MODELS:+-$MOE_MODELS}.jsonl" \
    2>&1 | grep -v '^{' | tail -80
}
deepseek() {  # DeepSeek-V2-Lite (MLA + MoE) and Qwen3-30B-A3B shapes at B=1 and B=32 (one
  # process per preset: one random init, two compiles; ~2 min each on the H200)
  for preset in ${MOE_PRESETS:-deepseek-v2-lite qwen3-30b-a3b}; do
    bench . deepseek --preset "$preset" --batch 1 32 --prompt-len 512 --gen-len 64 --repeats 2
  done
}
route() {  # the MoE router: XLA's ops (rows 0), one program a row (blocks 1), D in 16 blocks
  # (the default), with the boundary in the router's kernel (consumer) or not (kernel),
  # alternated, B = 1 (128 + 256); its tests
  local mem variants="${ROUTE_VARIANTS:-0,consumer,16 16,consumer,1 16,consumer,16 16,kernel,16}"
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  route_bench() {  # PRESET ARGS...: every variant once
    local preset=$1 v rows boundary blocks
    shift
    for v in $variants; do
      IFS=, read -r rows boundary blocks <<< "$v"
      bench . "route-${v//,/-}" --preset "$preset" $B1 "$@" --policy-field "moe_route_rows=$rows" \
        --policy-field "gated_mlp_boundary=$boundary" --policy-field "moe_route_blocks=$blocks"
    done
  }
  for _ in $(seq "${ROUNDS:-2}"); do route_bench mixtral-8x7b --quantization int4; done
  if [ "$mem" -gt 100000 ] && [ "${ROUTE_BF16:-1}" = 1 ]; then  # bf16 takes ~94 GB
    route_bench mixtral-8x7b
  fi
  route_bench qwen3-30b-a3b --quantization int4
  TESTS_TIMEOUT=150 gpu_tests tests/test_moe_kernels.py tests/test_moe.py \
    -k "router or mosaic or boundary_and"
}
gemma() {  # Gemma: the attention kernels, then the two presets' B=1 decode against the floor
  timeout "${KERNELS_TIMEOUT:-300}" python3 benchmarks/gemma_attention.py \
    --json "$out/gemma_attention.jsonl" 2>&1 | grep -v '^{' | tail -"${KERNELS_TAIL:-40}"
  for preset in ${GEMMA_PRESETS:-gemma3-27b gemma3-1b}; do
    # shellcheck disable=SC2086
    timeout 300 python3 benchmarks/decode.py --preset "$preset" --random-weights --json $B1 \
      2> >(grep -v '^bench' | tail -5 >&2) | sed "s/^{/{\"checkout\": \"gemma\", /" \
      | tee -a "$out/bench-gemma.jsonl"
  done
}
mla() {  # the absorbed MLA decode kernel: speed and variants, then its GPU tests
  # shellcheck disable=SC2086
  timeout "${MLA_TIMEOUT:-240}" python3 benchmarks/mla.py ${MLA_SHAPES:+--shapes "$MLA_SHAPES"} \
    --budget $(( ${MLA_TIMEOUT:-240} - 100 )) ${MLA_ARGS:-} --json "$out/mla.jsonl" 2>&1 \
    | grep -v '^{' | tail -"${MLA_TAIL:-70}"
  TESTS_TIMEOUT=120 gpu_tests tests/test_mla.py
}
paged() {  # paged decode attention: ours (pages, tilings) vs JAX's paged kernel, then tests
  # shellcheck disable=SC2086
  timeout "${PAGED_TIMEOUT:-280}" python3 benchmarks/paged_attention.py ${PAGED_ARGS:-} \
    --json "$out/paged_attention.jsonl" 2>&1 | grep -v '^{' | tail -"${PAGED_TAIL:-80}"
  TESTS_TIMEOUT=200 gpu_tests tests/test_paged_attention.py
}
multi8b() {  # tensor parallel against one GPU, same call
  bench . multi $B1 --tp 1
  bench . multi $B1 --tp 2
  bench . multi $B64 --tp 1
  bench . multi $B64 --tp 2
}
multi70b() {  # Llama-3-70B does not fit one H200 with a useful cache: tp 2 only
  bench . multi --preset llama3-70b --batch 1 --prompt-len 128 --gen-len 128 --tp 2
  bench . multi --preset llama3-70b --batch 32 --prompt-len 2048 --gen-len 64 --repeats 2 --tp 2
}
multiep() {  # expert parallel against the same model on one GPU
  for ep in 1 2; do
    bench . multi --preset mixtral-8x7b --batch 1 32 --prompt-len 128 --gen-len 128 --ep $ep
  done
}
multi() {
  for part in ${MULTI:-multi8b multi70b multiep}; do "$part"; done
  TESTS_TIMEOUT=200 gpu_tests tests/test_sharding.py
}
for part in "${@:-ours}"; do "$part"; done
