"""What the compiler made of the decode attention kernels: registers, spills, machine code.

    PYTHONPATH=. python3 benchmarks/ptx_probe.py --out DIR          # dump
    ncu ... python3 benchmarks/ptx_probe.py --no-dump --slots 384    # a workload for ncu

Runs, at Llama-3-8B batch-1 decode shapes, the separate kernels (norm_matmul's q/k/v
projection, decode_attention_append) and the fused `decode_qkv_attention`. With the dump on,
XLA writes its serialized GPU executables (`--xla_gpu_experimental_dump_gpu_executable`); the
cubins inside them are cut out and `cuobjdump` prints each kernel's registers, stack and local
memory (spills) and writes the SASS to DIR/{separate,fused}N.sass.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import struct
import subprocess
import sys
import tempfile


def elves(blob: bytes):
    """The 64-bit ELF images (cubins) inside a serialized executable."""
    at = blob.find(b"\x7fELF")
    while at >= 0:
        if blob[at + 4] == 2:
            shoff, = struct.unpack_from("<Q", blob, at + 0x28)
            shentsize, shnum = struct.unpack_from("<HH", blob, at + 0x3A)
            size = shoff + shentsize * shnum
            if 0 < size <= len(blob) - at:
                yield blob[at:at + size]
        at = blob.find(b"\x7fELF", at + 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--slots", type=int, default=161, help="cache slots (profile: 128 + 32 + 1)")
    p.add_argument("--no-dump", action="store_true", help="only run the kernels (under ncu)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    dump = tempfile.mkdtemp(prefix="xla-dump-")
    if not args.no_dump:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
                                   " --xla_gpu_experimental_dump_gpu_executable=true").strip()

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

    run_sep, run_fused = jax.jit(separate), jax.jit(fused)
    for _ in range(args.repeats):
        jax.block_until_ready(run_sep(x, nw, w, kc, vc, pos, deltas))
        jax.block_until_ready(run_fused(x, nw, w, kc, vc, pos, deltas, cnt))
    if args.no_dump:
        return 0

    os.makedirs(args.out, exist_ok=True)
    cubins = []
    for path in sorted(glob.glob(os.path.join(dump, "**", "*"), recursive=True)):
        m = re.search(r"jit_(fused|separate)", path)
        if not m or not os.path.isfile(path):
            continue
        for elf in elves(open(path, "rb").read()):
            name = os.path.join(dump, f"{m.group(1)}{len(cubins)}.cubin")
            open(name, "wb").write(elf)
            cubins.append(name)
    print("cubins:", [os.path.basename(c) for c in cubins])
    for name in cubins:
        r = subprocess.run(["cuobjdump", "-res-usage", name], capture_output=True, text=True)
        print(f"== {os.path.basename(name)}")
        print("\n".join(ln.strip()[:220] for ln in (r.stdout + r.stderr).splitlines()
                        if re.search(r"Function|REG|rror", ln)))
        r = subprocess.run(["cuobjdump", "-sass", name], capture_output=True, text=True)
        if re.search(r"attention", r.stdout):
            with open(os.path.join(args.out, os.path.basename(name) + ".sass"), "w") as f:
                f.write(r.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
