"""What the compiler made of the decode attention kernels: registers, spills, async copies.

    PYTHONPATH=. python3 benchmarks/ptx_probe.py --out DIR

Compiles, at Llama-3-8B batch-1 decode shapes, the separate kernels (norm_matmul's q/k/v
projection, decode_attention_append) and the fused `decode_qkv_attention`, with XLA's dump
on (`--xla_dump_to`), then for every kernel entry in the dumped PTX prints its register count
and spill bytes (`ptxas -v`, found in the CUDA wheels) and counts of the instructions that tell
a pipelined, spill-free loop from one that is not: cp.async / TMA copies, local-memory loads
and stores, global loads. Writes the kernels' PTX (only ours) to DIR for reading.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile


def find_ptxas() -> str | None:
    cands = [shutil.which("ptxas")]
    for base in sys.path:
        cands += glob.glob(os.path.join(base, "nvidia", "cuda_nvcc", "bin", "ptxas"))
    cands += glob.glob("/usr/local/cuda*/bin/ptxas")
    return next((c for c in cands if c and os.access(c, os.X_OK)), None)


def entries(ptx: str) -> dict[str, str]:
    """Kernel name -> its body in a PTX module."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+?)\s*\(", ptx):
        start = m.start()
        depth, i = 0, ptx.index("{", m.end())
        for j in range(i, len(ptx)):
            depth += {"{": 1, "}": -1}.get(ptx[j], 0)
            if depth == 0:
                out[m.group(1)] = ptx[start:j + 1]
                break
    return out


COUNTS = {"cp.async": r"cp\.async\.c[ag]", "tma": r"cp\.async\.bulk", "ld.local": r"ld\.local",
          "st.local": r"st\.local", "ld.global": r"ld\.global", "bar.sync": r"bar\.sync",
          "mma": r"mma\.sync|wgmma", "atom": r"atom\.", "loop labels": r"^\$L__BB\d+_\d+:"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--slots", type=int, default=161, help="cache slots (profile: 128 + 32 + 1)")
    args = p.parse_args()
    dump = tempfile.mkdtemp(prefix="xla-dump-")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()

    import jax
    import jax.numpy as jnp

    from pallas_kernels.decode_attention_append import decode_attention_append
    from pallas_kernels.decode_qkv_attention import decode_qkv_attention
    from pallas_kernels.norm_matmul import norm_matmul

    b, s, k, hkv, g, d = 1, args.slots, 4096, 8, 4, 128
    dt = jnp.bfloat16
    key = jax.random.PRNGKey(0)
    x = jax.random.normal(key, (b, k), dt)
    nw = jnp.ones((k,), dt)
    w = (jax.random.normal(key, (k, hkv, g + 2, d), jnp.float32) * 0.02).astype(dt)
    kc = jax.random.normal(key, (b, s, hkv, d), dt)
    vc = jax.random.normal(key, (b, s, hkv, d), dt)
    pos = jnp.full((b,), s - 2, jnp.int32)
    cos, sin = jnp.ones((b, d), jnp.float32), jnp.zeros((b, d), jnp.float32)
    deltas = jnp.zeros((2, b, k), jnp.float32)
    cnt = jnp.zeros((hkv,), jnp.int32)

    def separate(x, nw, w, kc, vc, pos, deltas):
        x2, (parts, ss) = norm_matmul(x, nw, w, eps=1e-5, partials=True, deltas=deltas)
        o, kc, vc = decode_attention_append(parts, kc, vc, pos, rope=(cos, sin),
                                            norm=(ss, k, 1e-5))
        return x2, o, kc, vc

    def fused(x, nw, w, kc, vc, pos, deltas, cnt):
        return decode_qkv_attention(x, nw, w, kc, vc, pos, cnt, rope=(cos, sin), eps=1e-5,
                                    deltas=deltas)

    jax.block_until_ready(jax.jit(separate)(x, nw, w, kc, vc, pos, deltas))
    jax.block_until_ready(jax.jit(fused)(x, nw, w, kc, vc, pos, deltas, cnt))

    ptxas = find_ptxas()
    print("ptxas:", ptxas)
    os.makedirs(args.out, exist_ok=True)
    kept = []
    for path in sorted(glob.glob(os.path.join(dump, "**", "*"), recursive=True)):
        if not os.path.isfile(path) or os.path.getsize(path) > 200e6:
            continue
        ptx = open(path, errors="replace").read()
        if ".entry" not in ptx or ".version" not in ptx:
            continue
        for name, body in entries(ptx).items():
            if not re.search(r"norm_matmul|attention", name):
                continue
            counts = {c: len(re.findall(rx, body, re.M)) for c, rx in COUNTS.items()}
            print(f"\n{name} ({os.path.basename(path)}): " +
                  ", ".join(f"{c} {n}" for c, n in counts.items()))
            kept.append(path)
    for path in sorted(set(kept)):
        shutil.copy(path, os.path.join(args.out, re.sub(r"[^A-Za-z0-9._-]", "_",
                                                        os.path.basename(path))[-60:] + ".ptx"))
        if ptxas:
            r = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull],
                               capture_output=True, text=True)
            info = [ln for ln in (r.stdout + r.stderr).splitlines()
                    if re.search(r"Compiling entry|registers|spill", ln)]
            print("\n".join(info[-40:]) or (r.stdout + r.stderr)[-2000:])
    if not kept:
        names = sorted(os.path.relpath(q, dump) for q in glob.glob(os.path.join(dump, "**", "*"),
                                                                   recursive=True))
        print("no kernel PTX in the dump:", [q for q in names if "fused" in q or "separate" in q])
    return 0


if __name__ == "__main__":
    sys.exit(main())
