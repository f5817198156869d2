#!/usr/bin/env bash
# The decode benchmarks of issue 5 on the lent H200, one part per device call (each < 10 min).
#   bash benchmarks/run_h200.sh ours   # jaxinfer bench: B=1 ctx 128+256, B=64 ctx 2k, B=1 ctx 32k
#   bash benchmarks/run_h200.sh peer   # HF transformers (static cache) on the same workload
# Results: one JSON line per run in ${OUT:-.}/bench-<part>.jsonl; a table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
case "${1:-ours}" in
  ours)
    for args in "--batch 1 --prompt-len 128 --gen-len 256 --dump-hlo $out/decode" \
                "--batch 64 --prompt-len 2048 --gen-len 128" \
                "--batch 1 --prompt-len 32768 --gen-len 128"; do
      python3 benchmarks/decode.py --preset llama3-8b --random-weights $args --json \
        2> >(grep -v '^bench' >&2) | tee -a "$out/bench-ours.jsonl"
    done ;;
  peer)
    python3 benchmarks/peer_hf.py --preset llama3-8b --batch 1 --prompt-len 128 --gen-len 256 \
      | tee -a "$out/bench-peer.jsonl" ;;
esac
