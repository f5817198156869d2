"""Quantized decode matmuls vs our bf16 decode matmul, in one run: correctness, then speed.

    PYTHONPATH=. python3 benchmarks/quantized.py --json out.json [--quick] [--formats q4_k,q6_k]
    PYTHONPATH=. python3 benchmarks/quantized.py --only mosaic --formats int8_g128,int4_g128 \
        --shapes 4096x28672,14336x4096 --ms 64 --configs 2-4-1,2-4-2   # configs at M = 64

For each shape K x N (Llama-3-8B's MLP 4096 x 14336, Llama-3-70B's 8192 x 28672) and rows M
(1, 16): the relative error of each weight format's compiled kernel against its jnp reference,
then the median time of the bf16 kernel (norm_matmul, the decode path's matmul), XLA's bf16
dot, and the quantized kernel for int8 g128, int4 g128 (symmetric and with offsets), int4 g32
with offsets, fp8 (one scale per column), and every GGUF block type kept quantized (Q8_0,
Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: random blocks through checkpoints/gguf_blocks.repack),
each as TB/s of its bytes, the fraction of the 4.27 TB/s floor and the speed-up over the bf16
kernel. Tile variants of the int4 kernel are timed beside the defaults; every format the
Mosaic GPU kernel takes (all of the above) also through it, as the decode path does on Hopper
(`mosaic`: the weight in the "nk" layout, int4 codes in the decode path's order (`mosaic f`:
fragment order), its bytes: 5- and 6-bit codes take a byte there; at
4096 x 14336, M = 1, int4 g32, Q4_0, Q8_0, Q4_K and Q6_K also in other kernel configurations),
and int4 g128 through torch's tinygemm (`_weight_int4pack_mm`, the gpt-fast peer; skipped with a note where
torch or CUDA is missing), with each row's speed-up over tinygemm. At M = 2048 (prefill) the kernel is timed against
dequantize-then-GEMM through XLA and the bf16 GEMM (TFLOP/s). Timing as benchmarks/kernels.py.
--shapes, --ms and --only (parts: odd, triton, mosaic, prefill) narrow the run; --configs
times those Mosaic configurations beside the default for every format at every shape (a
trailing "f": int4 codes in fragment order, skipped for other codes; without it, K order;
"w": 128-code tiles for groups under 128; "p": scales and offsets applied to the codes before
the product; the default's other configurations are then not timed: e.g. `--formats
q4_k,int4_g32_asym --ms 1 --configs 2-4-4fw,2-4-4fwp`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from benchmarks.kernels import PEAK_TBS, PEAK_TFLOPS, rel_err, time_fn
from benchmarks.ncu_quant import parse_configs
from pallas_kernels.norm_matmul import MatmulBlockSizes, default_block_sizes
from checkpoints import gguf_blocks
from jaxinfer.plan import KernelPolicy
from pallas_kernels.quantized import QuantizedWeight, dequantize, quantize_weight
from pallas_kernels.quantized_mgpu import MgpuMatmulConfig

RESULTS: list[dict] = []
FAILED: list[str] = []  # formats whose kernel raised (printed; the run goes on)
FORMATS = None  # the --formats names to run (None: all)
ALL_PARTS = ("odd", "triton", "mosaic", "prefill")
PARTS = set(ALL_PARTS)  # --only
CONFIGS: list[MgpuMatmulConfig] = []  # --configs: for every format at every shape
JSON_PATH = None  # --json
# Byte offsets of each block's fp16 fields (d, and m / dmin) in ggml's block_* structs.
FP16_AT = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_weight(kind: str, k: int, n: int, rng) -> QuantizedWeight:
    """A random [K, N] weight of GGUF block type kind as a file's is repacked on load
    (checkpoints/gguf_blocks.repack): random codes and sub-scales, small fp16 d / dmin."""
    block, size = gguf_blocks.BLOCK_SIZES[kind]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    for off in FP16_AT[kind]:
        raw[:, off:off + 2] = (rng.random(raw.shape[0]) * 1e-3).astype(np.float16).view(
            np.uint8).reshape(-1, 2)
    return jax.tree.map(jnp.asarray, gguf_blocks.repack(raw.reshape(n, -1), kind, k, n))


def formats(w, k: int, n: int, rng) -> dict:
    """name -> the weight in that format (the --formats ones; K-quants where K allows)."""
    make = {"int8_g128": lambda: quantize_weight(w, bits=8, group_size=128),
            "int4_g128": lambda: quantize_weight(w, bits=4, group_size=128),
            "int4_g128_asym": lambda: quantize_weight(w, bits=4, group_size=128,
                                                      symmetric=False),
            "int4_g32_asym": lambda: quantize_weight(w, bits=4, group_size=32,
                                                     symmetric=False),
            "fp8": lambda: quantize_weight(w, bits=8, float8=True, group_size=None)}
    for kind, (block, _) in gguf_blocks.BLOCK_SIZES.items():
        if k % block == 0:
            make[kind.lower()] = functools.partial(gguf_weight, kind, k, n, rng)
    return {name: f() for name, f in make.items() if FORMATS is None or name in FORMATS}


# Kernel configurations timed beside the default for groups under 128 at 4096 x 14336, M = 1
# (wide: 128-code tiles sliced per group in registers).
MOSAIC_VARIANTS = [MgpuMatmulConfig(gps=g, stages=st, splits=sp, batch=b, wide=w)
                   for g, st, sp, b, w in ((2, 4, 2, 0, False), (4, 4, 2, 0, False),
                                           (2, 6, 4, 0, False), (1, 8, 4, 0, False),
                                           (2, 4, 4, 4, False), (2, 4, 4, 0, True),
                                           (4, 4, 2, 0, True), (2, 6, 4, 0, True))]


def guarded(what: str, fn) -> None:
    """fn() (one format's rows); an exception is printed and kept in FAILED, not fatal."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- one format failing must not end the run
        print(f"FAILED {what}: {type(exc).__name__}: {str(exc)[:1500]}", flush=True)
        FAILED.append(what)


def record(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    if JSON_PATH:  # rewritten after each row: a run cut short keeps what it timed
        with open(JSON_PATH, "w") as f:
            json.dump(RESULTS, f, indent=1)


def bench_decode(k: int, n: int, m: int, iters: int, sets: int, rng, variants: bool) -> None:
    ws = [jax.random.normal(jax.random.key(i), (k, n), jnp.bfloat16) * 0.02 for i in range(sets)]
    xs = [jax.random.normal(jax.random.key(100 + i), (m, k), jnp.bfloat16) for i in range(sets)]
    bf16_bytes = k * n * 2 + m * k * 2
    dense = jax.jit(lambda x, w: pk.norm_matmul(x, None, w))
    t_dense = time_fn(dense, list(zip(xs, ws)), iters=iters)
    t_xla = time_fn(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32
                                                 ).astype(x.dtype)), list(zip(xs, ws)),
                    iters=iters)
    for name, t, nbytes in (("bf16 kernel", t_dense, bf16_bytes), ("bf16 xla", t_xla, bf16_bytes)):
        record(op="decode", k=k, n=n, m=m, weights=name, ms=t * 1e3, tbs=nbytes / t / 1e12,
               floor=nbytes / t / 1e12 / PEAK_TBS, vs_bf16_kernel=t_dense / t)
    qsets = [formats(w, k, n, rng) for w in ws]
    for name in qsets[0]:
        qs = [q[name] for q in qsets]
        nbytes = qs[0].nbytes() + m * k * 2

        def triton(name=name, qs=qs, nbytes=nbytes):
            err = rel_err(pk.quantized_matmul(xs[0], qs[0]),
                          pk.quantized_matmul_reference(xs[0], qs[0]))
            tiles = {"default": None}
            if variants and name in ("int4_g128", "int8_g128", "q4_k"):
                base = default_block_sizes(m, n, k, 2)
                tiles.update({f"bn{bn}_s{s}_w{w_}_st{st}": MatmulBlockSizes(
                    block_m=16, block_n=bn, block_k=128, num_warps=w_, num_stages=st, split_k=s)
                    for bn, s, w_, st in ((128, base.split_k, 4, 3), (64, 2 * base.split_k, 4, 3),
                                          (64, 4 * base.split_k, 4, 3),
                                          (128, 2 * base.split_k, 4, 3),
                                          (64, 2 * base.split_k, 4, 5), (32, base.split_k, 4, 3))})
            for tname, blocks in tiles.items():
                fn = jax.jit(lambda x, q, b=blocks: pk.quantized_matmul(x, q, block_sizes=b))
                t = time_fn(fn, list(zip(xs, qs)), iters=iters)
                record(op="decode", k=k, n=n, m=m, weights=name, tiles=tname, err=err,
                       ms=t * 1e3, tbs=nbytes / t / 1e12, floor=nbytes / t / 1e12 / PEAK_TBS,
                       vs_bf16_kernel=t_dense / t, bytes_ratio=bf16_bytes / nbytes)
        if "triton" in PARTS:
            guarded(f"{name} {k}x{n} M={m} triton", triton)

        def mosaic(name=name, qs=qs):  # the decode path on Hopper
            # the codes in K order and in fragment order (int4 only; others as they are):
            # the default row takes the decode path's, a --configs one its own ("f")
            ks = [pk.to_nk(q) for q in qs]
            # (to_nk gives other codes back as they are: no second copy)
            order = {False: ks, True: [pk.to_nk(w, frag=True) for w in ks]}
            nks = order[KernelPolicy().int4_fragment_order]
            nk_bytes = nks[0].nbytes() + m * k * 2
            want = pk.quantized_matmul_reference(xs[0], qs[0])
            cfgs = {"mosaic": None}
            if variants and not CONFIGS and name in ("int4_g32_asym", "q4_0", "q8_0", "q4_k",
                                                     "q6_k"):
                cfgs.update({f"mosaic_{c}": c for c in MOSAIC_VARIANTS})
            from benchmarks.quant_designs import mgpu_fits
            cfgs.update({f"mosaic_{c}": c for c in CONFIGS if mgpu_fits(c, k, n)})
            for tname, cfg in cfgs.items():
                ws = nks if cfg is None else order[cfg.frag]
                if cfg is not None and cfg.frag and not ws[0].frag:
                    continue  # fragment order is for int4 codes
                fn = jax.jit(lambda x, q, c=cfg: pk.quantized_matmul_mgpu(x, q, cfg=c))
                e = rel_err(fn(xs[0], ws[0]), want)  # each configuration checked
                t = time_fn(fn, list(zip(xs, ws)), iters=iters)
                if cfg is None and nks[0].frag:
                    tname += " f"  # the default, codes in fragment order
                record(op="decode", k=k, n=n, m=m, weights=name, tiles=tname, err=e,
                       ms=t * 1e3, tbs=nk_bytes / t / 1e12,
                       floor=nk_bytes / t / 1e12 / PEAK_TBS, vs_bf16_kernel=t_dense / t,
                       bytes_ratio=bf16_bytes / nk_bytes)
        if pk.nk_unfit(qs[0]) is None and "mosaic" in PARTS:
            guarded(f"{name} {k}x{n} M={m} mosaic", mosaic)
        if name == "int4_g128" and TORCH is not None:  # the gpt-fast peer: tinygemm
            tiny = tinygemm(qs, xs, m, k, n, iters)
            if tiny is not None:
                t, e = tiny
                record(op="decode", k=k, n=n, m=m, weights="int4_g128 torch tinygemm", err=e,
                       ms=t * 1e3, tbs=nbytes / t / 1e12, floor=nbytes / t / 1e12 / PEAK_TBS,
                       vs_bf16_kernel=t_dense / t)
        if name == "int4_g128":  # the peer a plain JAX user writes: dequantize, then dot
            fn = jax.jit(lambda x, q: jnp.dot(x, dequantize(q, x.dtype),
                                              preferred_element_type=jnp.float32).astype(x.dtype))
            t = time_fn(fn, list(zip(xs, qs)), iters=iters)
            record(op="decode", k=k, n=n, m=m, weights="int4_g128 xla dequant+dot", ms=t * 1e3,
                   tbs=nbytes / t / 1e12, vs_bf16_kernel=t_dense / t)


TORCH = None  # torch with CUDA, set in main (None: no tinygemm rows)


def tinygemm(qs, xs, m: int, k: int, n: int, iters: int):
    """(seconds, rel err) of torch's tinygemm on the same codes and scales, or None."""
    from benchmarks.quant_designs import GROUP, tinygemm_pack, time_torch
    from pallas_kernels.quantized import codes_of

    try:
        packed = [tinygemm_pack(TORCH, dict(q=q, u8=(codes_of(q) + q.code_offset).astype(
            jnp.uint8))) for q in qs]
        txs = [TORCH.from_numpy(np.array(x.astype(jnp.float32))).cuda().to(TORCH.bfloat16)
               for x in xs]
        call = lambda x, w, sz: TORCH.ops.aten._weight_int4pack_mm(x, w, GROUP, sz)  # noqa
        arg_sets = [(tx, w, sz) for tx, (w, sz) in zip(txs, packed)]
        y = jnp.asarray(call(*arg_sets[0]).float().cpu().numpy())
        err = rel_err(y, pk.quantized_matmul_reference(xs[0], qs[0]))
        t, _ = time_torch(TORCH, call, arg_sets, iters=iters, link=True)
        return t, err
    except Exception as exc:  # noqa: BLE001 -- the peer failing must not end the run
        print(f"tinygemm {k}x{n} M={m} failed: {type(exc).__name__}: {str(exc)[:500]}",
              flush=True)
        return None


def bench_prefill(k: int, n: int, m: int, iters: int, rng) -> None:
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.bfloat16) * 0.02
    x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
    flops = 2 * m * k * n
    t = time_fn(jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32
                                             ).astype(x.dtype)), [(x, w)], iters=iters)
    record(op="prefill", k=k, n=n, m=m, weights="bf16 xla", ms=t * 1e3,
           tflops=flops / t / 1e12, frac=flops / t / 1e12 / PEAK_TFLOPS)
    for name, q in formats(w, k, n, rng).items():
        if name not in ("int8_g128", "int4_g128", "q4_k"):
            continue
        err = rel_err(pk.quantized_matmul(x, q), pk.quantized_matmul_reference(x, q))
        for how, fn in (("kernel", jax.jit(lambda x, q: pk.quantized_matmul(x, q))),
                        ("xla dequant+gemm", jax.jit(lambda x, q: jnp.dot(
                            x, dequantize(q, x.dtype),
                            preferred_element_type=jnp.float32).astype(x.dtype)))):
            t = time_fn(fn, [(x, q)], iters=iters)
            record(op="prefill", k=k, n=n, m=m, weights=f"{name} {how}", err=err, ms=t * 1e3,
                   tflops=flops / t / 1e12, frac=flops / t / 1e12 / PEAK_TFLOPS)


def check_odd_shapes(rng) -> None:
    """Every format at shapes that are not tile multiples, compiled, against the reference."""
    for m, k, n in ((1, 768, 200), (7, 512, 1000), (16, 1280, 96)):
        w = jax.random.normal(jax.random.key(m), (k, n), jnp.float32) * 0.02
        x = jax.random.normal(jax.random.key(k), (m, k), jnp.bfloat16)
        nw = jax.random.normal(jax.random.key(n), (k,), jnp.bfloat16)
        for name, q in formats(w, k, n, rng).items():
            if k % 256 and name.startswith("q"):
                continue
            e1 = rel_err(pk.quantized_matmul(x, q), pk.quantized_matmul_reference(x, q))
            e2 = rel_err(pk.swiglu(x, q, q, norm_weight=nw),
                         pk.swiglu_reference(x, q, q, norm_weight=nw))
            record(op="check", m=m, k=k, n=n, weights=name, matmul_err=e1, swiglu_err=e2,
                   ok=bool(e1 < 1e-2 and e2 < 2e-2))


def main() -> int:
    global FORMATS, PARTS, JSON_PATH
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--formats", default=None,
                    help="comma-separated format names (int8_g128, int4_g128, int4_g128_asym, "
                         "int4_g32_asym, fp8, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k)")
    ap.add_argument("--shapes", default=None, metavar="KxN,...",
                    help="decode shapes (default 4096x14336, 8192x28672; --quick: the first)")
    ap.add_argument("--ms", default="1,16", help="decode rows, comma-separated")
    ap.add_argument("--only", default=None, metavar="PART,...",
                    help=f"run only these parts of {', '.join(ALL_PARTS)}")
    ap.add_argument("--configs", default=None, metavar="G-S-K[-B][fwp],...",
                    help="Mosaic configurations timed beside the default for every format "
                         "(gps-stages-splits[-batch]; f: int4 codes in fragment order, w: 128-code "
                         "tiles, p: scales before the product)")
    args = ap.parse_args()
    FORMATS = None if args.formats is None else set(args.formats.split(","))
    JSON_PATH = args.json
    try:
        CONFIGS[:] = parse_configs(args.configs) if args.configs else []
        shapes = ([tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
                  if args.shapes else None)
        ms = [int(v) for v in args.ms.split(",")]
    except ValueError:
        ap.error("--shapes KxN,..., --ms M,... and --configs G-S-K[-B],... take integers")
    if args.only:
        PARTS = set(args.only.split(","))
        if PARTS - set(ALL_PARTS):
            ap.error(f"--only: parts of {', '.join(ALL_PARTS)}; got {args.only}")
    rng = np.random.default_rng(0)
    global TORCH
    if jax.default_backend() == "gpu":
        from benchmarks.quant_designs import torch_setup
        notes = []
        TORCH = torch_setup(notes)
        for note in notes:
            print(f"# {note}", flush=True)
    if "odd" in PARTS:
        check_odd_shapes(rng)
    shapes = shapes or ([(4096, 14336)] if args.quick else [(4096, 14336), (8192, 28672)])
    for k, n in shapes:
        for m in ms:
            bench_decode(k, n, m, iters=50, sets=2 if k * n > 10 ** 8 else 4, rng=rng,
                         variants=(k, n, m) == (4096, 14336, 1))
    if "prefill" in PARTS:
        bench_prefill(4096, 14336, 2048, iters=10, rng=rng)
    print("\nop       K     N      M  weights                        ms     TB/s  x bf16  x tiny")
    tiny = {(r["k"], r["n"], r["m"]): r["ms"] for r in RESULTS
            if r["op"] == "decode" and r["weights"] == "int4_g128 torch tinygemm"}
    for r in RESULTS:
        if r["op"] == "decode":
            t = tiny.get((r["k"], r["n"], r["m"]))
            vt = f"{t / r['ms']:6.2f}" if t else ""
            print(f"decode {r['k']:5d} {r['n']:6d} {r['m']:3d}  {r['weights'] + ' ' + r.get('tiles', ''):30s}"
                  f" {r['ms']:7.4f} {r['tbs']:6.2f}  {r['vs_bf16_kernel']:5.2f}  {vt}")
        elif r["op"] == "prefill":
            print(f"prefill {r['k']:4d} {r['n']:6d} {r['m']:5d} {r['weights']:30s} {r['ms']:7.3f} "
                  f"{r['tflops']:6.1f} TFLOP/s")
    bad = [r for r in RESULTS if r["op"] == "check" and not r["ok"]]
    print(f"\nchecks: {sum(r['op'] == 'check' for r in RESULTS) - len(bad)} ok, {len(bad)} bad")
    if FAILED:
        print(f"{len(FAILED)} failed: {FAILED}")
    return 1 if bad or FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
