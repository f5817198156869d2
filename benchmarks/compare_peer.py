"""Ours beside the peer: the issue-5 table from `jaxinfer bench --json` and peer_hf.py lines.

    python3 benchmarks/compare_peer.py bench-ours.jsonl bench-peer.jsonl

Reads the JSON lines of both files (other lines are skipped), pairs each of our runs with the
peer's run of the same model, batch, prompt and generation lengths (the last one of each, when a
file holds several), and prints a Markdown table: preset, batch, context, ms/token, tok/s,
fraction of the bandwidth floor, the peer's ms/token and tok/s, and ours / peer (the peer's
time over ours: above 1 means we are faster). Runs without a peer run get empty peer columns.
"""

from __future__ import annotations

import json
import sys


def read_runs(path: str) -> dict:
    """(model, batch, prompt_len, gen_len) -> the last JSON object with those fields."""
    runs = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "decode_ms_per_token" in r:
                runs[(r["model"], r["batch"], r["prompt_len"], r["gen_len"])] = r
    return runs


def table(ours: dict, peer: dict) -> str:
    head = ("| preset | batch | context | ms/token | tok/s | fraction of floor | peer | "
            "peer ms/token | peer tok/s | ours / peer |")
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for key, r in ours.items():
        model, batch, prompt, gen = key
        frac = r.get("floor_fraction")
        p = peer.get(key)
        cells = [model, str(batch), f"{prompt}+{gen}", f"{r['decode_ms_per_token']:.3f}",
                 f"{r['decode_tokens_per_s']:.1f}",
                 f"{frac * 100:.1f}%" if frac is not None else "",
                 p.get("peer", "") if p else "",
                 f"{p['decode_ms_per_token']:.3f}" if p else "",
                 f"{p['decode_tokens_per_s']:.1f}" if p else "",
                 f"{p['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x" if p else ""]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python3 benchmarks/compare_peer.py OURS.jsonl PEER.jsonl", file=sys.stderr)
        return 2
    ours, peer = read_runs(argv[0]), read_runs(argv[1])
    if not ours:
        print(f"compare_peer: no `jaxinfer bench --json` lines in {argv[0]}", file=sys.stderr)
        return 1
    print(table(ours, peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
