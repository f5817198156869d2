"""Absorbed MLA decode attention (pallas_kernels/mla.py) vs XLA, in one run: checks, then speed.

    PYTHONPATH=. python3 benchmarks/mla.py --json out.jsonl       # the H200: DeepSeek-V2-Lite
    PYTHONPATH=. python3 benchmarks/mla.py --quick                # any CPU: a tiny shape, interpret
    PYTHONPATH=. python3 benchmarks/mla.py --kinds int8,fp8 --shapes 8x4096,32x8192
    PYTHONPATH=. python3 benchmarks/mla.py --tune --kinds bf16    # + the bf16 tuning candidates

DeepSeek-V2-Lite attention shapes (H 16, R = kv_lora_rank 512, Dr = qk_rope_head_dim 64,
qk_nope 128, v_head 128), bf16 queries, one new token per sequence, every cache slot valid: B in
{8, 32} x S in {4096, 8192}, and B = 1 at S = 32768. Per shape and latent kind (--kinds: bf16,
int8, fp8: the latent cache of kv_dtype None / "int8" / "fp8", codes with a float32 scale per
token for c_KV and one for k_rope), in one call:

- ours: `mla_decode_attention` with its default block sizes and a few variants (tile, warps,
  stages, splits, an R split), so one run says which is best; with --tune (bf16) also the
  candidates for the B8 / B32 goal (`tune_variants`: more splits with 16-bit partials, 64-slot
  tiles, 8 warps, more stages) and the split merge alone (its share of the call);
- ours paged: `paged_mla_attention` (the engine's form) on the same latents laid out as
  shuffled pages of 64 (a row's tiles read through its block table), default blocks;
- xla absorbed: `mla_decode_attention_reference` compiled by XLA (the same math in einsums; on
  codes it dequantizes to float32 first);
- xla expanded (bf16 only): the non-absorbed path: K = [c_KV @ W_UK ; k_rope], V = c_KV @ W_UV
  per head, then ordinary attention (what decode costs when the latent is expanded every step).

Each is checked against the reference on the same latent (relative error, bf16 tolerance
1.5e-2; the expanded path's output is compared with the reference's output @ W_UV); a quantized
row also reports its error against the bf16 latent's output (the format's own error). Reported:
ms, the bytes read per second (TB/s: B x S x the latent's bytes per token, codes + scales for
int8 / fp8), its fraction of 4.8 TB/s (the H200's HBM) and of 4.27 TB/s (the measured copy the
other benchmarks use), and the bytes per token and layer (bf16 1152, int8 / fp8 576 + 8 of
scales) against the MHA equivalent (16 x (192 + 128) x 2). Timing is benchmarks/kernels.py's
(warm-up outside, median of repeats, inputs rotated when they fit in L2, short calls chained
in one program). JSON lines (stdout and --json), then a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from benchmarks.kernels import L2_BYTES, PEAK_TBS, guarded, iters_for, rel_err, time_fn
from pallas_kernels.decode_attention import _merge_splits
from pallas_kernels.kv_quant import quantize_latent

HBM_TBS = 4.8  # the H200's HBM3e bandwidth (the issue's floor)
TOL_BF16 = 1.5e-2
# DeepSeek-V2-Lite: heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
HEADS, RANK, ROPE, NOPE, VDIM = 16, 512, 64, 128, 128
# the targets first, so a run cut short by its timeout still has them
SHAPES = ((8, 4096), (32, 8192), (1, 32768), (8, 8192), (32, 4096))
QUICK_SHAPES = ((2, 256),)
# latent kinds: code dtype (None: the bf16 latent itself)
KINDS = {"bf16": None, "int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}
SCALE_BYTES = 2 * 4  # per token: c_KV's and k_rope's float32 scales

RESULTS: list[dict] = []


def bytes_per_token(kind: str) -> int:
    """Latent bytes per token and layer: 576 bf16 values, or 576 codes and two scales."""
    d = RANK + ROPE
    return d * 2 if KINDS[kind] is None else d + SCALE_BYTES


def variants(quick: bool, kind: str = "bf16") -> list[tuple[str, pk.MLABlockSizes | None]]:
    """(name, block sizes) of our kernel, the default first; splits variants are added per
    shape (`split_variants`). Quantized latents: the default and the tiles whose stage count
    the 1-byte codes change."""
    mb = pk.MLABlockSizes
    if quick:
        return [("default", None), ("bs16 R256", mb(block_s=16, block_r=256)),
                ("splits3", mb(num_splits=3)),
                ("splits3 bf16 partials", mb(num_splits=3, q_dtype_partials=True))]
    if kind != "bf16":
        return [("default", None),
                ("st3", mb(num_stages=3)),
                ("bs64 w8 st3", mb(block_s=64, num_warps=8, num_stages=3)),
                ("bf16 partials", mb(q_dtype_partials=True))]
    return [("default", None),
            ("bs32 st4", mb(block_s=32, num_stages=4)),
            ("bs64 st2", mb(block_s=64, num_stages=2)),
            ("bs16 st4", mb(block_s=16, num_stages=4)),
            ("R256", mb(block_r=256)),
            ("bf16 partials", mb(q_dtype_partials=True))]


def split_variants(b: int, s: int) -> list[tuple[str, pk.MLABlockSizes]]:
    """The default tiles with half and twice the default number of chunks (twice also with
    bf16 partials)."""
    default = pk.MLABlockSizes()
    splits = default.resolve(b, HEADS, RANK, s).num_splits
    out = []
    for n in sorted({max(1, splits // 2), min(s // default.block_s, 2 * splits)} - {splits}):
        out.append((f"default splits{n}", pk.MLABlockSizes(num_splits=n)))
        if n > splits:
            out.append((f"bf16 partials splits{n}",
                        pk.MLABlockSizes(num_splits=n, q_dtype_partials=True)))
    return out


def tune_variants(b: int, s: int) -> list[tuple[str, pk.MLABlockSizes]]:
    """Candidates for the bf16 goal (>= 3.8 TB/s at B >= 8, S >= 4k; DECISIONS.md "MLA
    decode"), each one change from the default. B8 runs one program per SM (16 splits of 256
    slots) and writes a 32 KiB float32 partial per 295 KiB chunk read (+22% traffic with the
    merge's read): more programs with 16-bit partials, more bytes in flight per program (64-slot
    tiles, 8 warps, 4 stages). B32 (8 splits of 1024) is nearer its floor: the same tiles and
    split counts (split_variants has half and twice the default at 4 warps)."""
    mb = pk.MLABlockSizes
    splits = mb().resolve(b, HEADS, RANK, s).num_splits
    most = s // 32
    out = [("w8", mb(num_warps=8)),
           ("w8 st4", mb(num_warps=8, num_stages=4)),
           ("bs64 w8 st2", mb(block_s=64, num_warps=8, num_stages=2)),
           ("bs16 st6", mb(block_s=16, num_stages=6)),
           ("bs64 st2 bf16 partials", mb(block_s=64, num_stages=2, q_dtype_partials=True))]
    for n in sorted({min(most, 2 * splits), min(most, 3 * splits), min(most, 4 * splits)}
                    - {splits}):
        if n != min(most, 2 * splits):  # twice the splits: split_variants has it at 4 warps
            out.append((f"bf16 partials splits{n}", mb(num_splits=n, q_dtype_partials=True)))
        out.append((f"bf16 partials w8 splits{n}",
                    mb(num_splits=n, num_warps=8, q_dtype_partials=True)))
    return out


def merge_only(b: int, splits: int, q_dtype_partials: bool, weights_first: bool = False):
    """The split merge alone on partials of the default tiling: (fn, args, bytes it reads).
    weights_first=False: as the kernel's wrapper runs it (_merge_splits; 16-bit partials
    rescaled by l first); True, a candidate form: each chunk's weight l_c 2^(m_c - M) / L
    first (a [B, splits, rows] array), then one weighted sum over the partials (for float32
    ones a chunk with l = 0 would need a guard; the timing's l are >= 1)."""
    rows, dtype = HEADS, jnp.bfloat16 if q_dtype_partials else jnp.float32
    k = jax.random.split(jax.random.PRNGKey(splits), 3)
    acc = jax.random.normal(k[0], (b, splits, rows, RANK)).astype(dtype)
    m = jax.random.normal(k[1], (b, splits, rows))
    l = jax.random.uniform(k[2], (b, splits, rows), minval=1.0, maxval=2.0)

    @jax.jit
    def merge(acc, m, l):
        if q_dtype_partials:
            acc = acc.astype(jnp.float32) * l[..., None]
        out = _merge_splits(acc[:, None], m[:, None], l[:, None])[:, 0]
        return out.astype(jnp.bfloat16)

    @jax.jit
    def merge_weights_first(acc, m, l):
        w = l * jnp.exp2(m - jnp.max(m, axis=1, keepdims=True))  # [B, splits, rows]
        if not q_dtype_partials:  # unnormalized float32 partials: their own l divides
            w = w / l
        w = w / jnp.sum(l * jnp.exp2(m - jnp.max(m, axis=1, keepdims=True)), axis=1,
                        keepdims=True)
        out = jnp.einsum("bcr,bcrd->brd", w, acc, preferred_element_type=jnp.float32)
        return out.astype(jnp.bfloat16)

    nbytes = acc.size * acc.dtype.itemsize + 2 * m.size * 4
    return (merge_weights_first if weights_first else merge), [(acc, m, l)], nbytes


def expanded_attention(q_nope, q_rope, latent, lengths, w_uk, w_uv, sm_scale):
    """Non-absorbed MLA decode: q_nope [B, H, Dn], q_rope [B, H, Dr], latent [B, S, R + Dr],
    w_uk [R, H, Dn], w_uv [R, H, Dv] -> [B, H, Dv] (K/V expanded from the latent every call)."""
    c_kv, k_rope = latent[..., :RANK], latent[..., RANK:]  # [B, S, R], [B, S, Dr]
    k_nope = jnp.einsum("bsr,rhd->bshd", c_kv, w_uk)  # [B, S, H, Dn]
    v = jnp.einsum("bsr,rhd->bshd", c_kv, w_uv)  # [B, S, H, Dv]
    scores = (jnp.einsum("bhd,bshd->bhs", q_nope, k_nope, preferred_element_type=jnp.float32)
              + jnp.einsum("bhd,bsd->bhs", q_rope, k_rope,
                           preferred_element_type=jnp.float32)) * sm_scale  # [B, H, S]
    valid = jnp.arange(latent.shape[1])[None, None, :] < lengths[:, None, None]
    p = jax.nn.softmax(jnp.where(valid, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhs,bshd->bhd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q_nope.dtype)


def emit(row: dict) -> dict:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)
    return row


PAGE = 64  # the engine's page size on a GPU


def paged_args(args, b: int, s: int, sm_scale: float, interpret: bool):
    """`paged_mla_attention` on the sets' latents (and scales) as pages of PAGE in a shuffled
    pool (row b's pages scattered), each row's one query at its last slot -> (fn, args)."""
    w = s // PAGE
    order = jax.random.permutation(jax.random.PRNGKey(s), b * w)  # pool page of (row, page)
    tables = jnp.argsort(order).astype(jnp.int32).reshape(b, w)  # row b's page j's pool page
    positions = jnp.full((b, 1), s - 1, jnp.int32)

    def pool(x):  # [B, S, ...] -> [B * W, PAGE, ...] in the shuffled order
        return x.reshape(b * w, PAGE, *x.shape[2:])[order]
    fn = jax.jit(lambda q, lat, t, pos, sc=None: pk.paged_mla_attention(
        q, lat, t, pos, sm_scale=sm_scale, latent_scale=sc, interpret=interpret))
    out = [(q, pool(lat), tables, positions) + (() if len(a) == 3 else (pool(a[3]),))
           for a in args for q, lat in [a[:2]]]
    return fn, out


def bench_shape(b: int, s: int, quick: bool, interpret: bool, kinds=("bf16",),
                tune: bool = False) -> None:
    dtype = jnp.bfloat16
    d = RANK + ROPE
    shape = f"B{b} S{s} H{HEADS} R{RANK} Dr{ROPE}"
    latent_bytes = b * s * d * 2  # every slot valid
    n_sets = 1 if interpret else max(1, min(8, math.ceil(3 * L2_BYTES / latent_bytes)))
    keys = jax.random.split(jax.random.PRNGKey(b * 7919 + s), 6)
    sm_scale = 1.0 / math.sqrt(NOPE + ROPE)
    # W_UK / W_UV at the fan-in scale, so that absorbed and expanded scores stay O(1)
    w_uk = (jax.random.normal(keys[0], (RANK, HEADS, NOPE)) / math.sqrt(NOPE)).astype(dtype)
    w_uv = (jax.random.normal(keys[1], (RANK, HEADS, VDIM)) / math.sqrt(RANK)).astype(dtype)
    lengths = jnp.full((b,), s, jnp.int32)
    sets = []
    for i in range(n_sets):
        kq, kr, kl = jax.random.split(jax.random.fold_in(keys[2], i), 3)
        q_nope = jax.random.normal(kq, (b, HEADS, NOPE)).astype(dtype)
        q_rope = jax.random.normal(kr, (b, HEADS, ROPE)).astype(dtype)
        latent = jax.random.normal(kl, (b, s, d)).astype(dtype)
        # the absorbed query (the model's matmul, outside the timed attention)
        q_lat = jnp.einsum("bhd,rhd->bhr", q_nope, w_uk, preferred_element_type=jnp.float32)
        q = jnp.concatenate([q_lat.astype(dtype), q_rope], axis=-1)[:, None]  # [B, 1, H, 576]
        sets.append((q, latent, q_nope, q_rope))
    ref_fn = jax.jit(lambda q, lat, n, sc=None: pk.mla_decode_attention_reference(
        q, lat, n, sm_scale=sm_scale, latent_scale=sc))
    bf16_ref = ref_fn(sets[0][0], sets[0][1], lengths)  # [B, 1, H, R]
    iters = 2 if interpret else iters_for(latent_bytes / 3e12)
    repeats = 1 if interpret else 5
    emit(dict(part="bytes", shape=shape, latent_bytes_per_token=d * 2,
              **{f"{k}_bytes_per_token": bytes_per_token(k) for k in KINDS if k != "bf16"},
              mha_bytes_per_token=HEADS * (NOPE + ROPE + VDIM) * 2,
              mha_over_latent=HEADS * (NOPE + ROPE + VDIM) / d))

    def measure(impl, kind, fn, args, check, nbytes, **extra):
        err = check(fn(*args[0]))
        secs = time_fn(fn, args, iters=iters, repeats=repeats)
        tbs = nbytes / secs / 1e12
        return emit(dict(part="time", shape=shape, b=b, s=s, kind=kind, impl=impl,
                         ms=secs * 1e3, bytes_read=nbytes, latent_tbs=tbs,
                         frac_4_8=tbs / HBM_TBS, frac_4_27=tbs / PEAK_TBS, err=err,
                         ok=bool(err < TOL_BF16), **extra))

    for kind in kinds:
        code = KINDS[kind]
        nbytes = b * s * bytes_per_token(kind)
        if code is None:
            args = [(q, lat, lengths) for q, lat, _, _ in sets]
            ref = bf16_ref
            extra = {}
        else:  # codes + scales of the same latents; checked against the reference on them
            quant = jax.jit(lambda lat, code=code: quantize_latent(lat, RANK, code))
            args = [(q, *quant(lat), lengths) for q, lat, _, _ in sets]
            args = [(q, codes, n, sc) for q, codes, sc, n in args]  # (q, codes, lengths, scale)
            ref = ref_fn(*args[0])
            extra = {"err_vs_bf16_latent": rel_err(ref, bf16_ref)}

        def check(out, ref=ref):
            return rel_err(out, ref)
        guarded(f"xla absorbed {kind} {shape}", measure, "xla absorbed", kind, ref_fn, args,
                check, nbytes, **extra)
        if code is None:
            ref_v = jnp.einsum("bhr,rhd->bhd", ref[:, 0].astype(jnp.float32),
                               w_uv.astype(jnp.float32))
            expanded = jax.jit(lambda qn, qr, lat, n: expanded_attention(
                qn, qr, lat, n, w_uk, w_uv, sm_scale))
            guarded(f"xla expanded {shape}", measure, "xla expanded", kind, expanded,
                    [(qn, qr, lat, lengths) for _, lat, qn, qr in sets],
                    lambda out, ref_v=ref_v: rel_err(out, ref_v), nbytes)
        todo = variants(quick, kind)
        if not quick and code is None:
            todo += split_variants(b, s) + (tune_variants(b, s) if tune else [])
        elif not quick:
            todo += [(n, v) for n, v in split_variants(b, s) if "bf16" in n]
        for name, blocks in todo:
            fn = jax.jit(lambda q, lat, n, sc=None, blocks=blocks: pk.mla_decode_attention(
                q, lat, n, sm_scale=sm_scale, block_sizes=blocks, latent_scale=sc,
                interpret=interpret))
            t = (blocks or pk.MLABlockSizes()).resolve(b, HEADS, RANK, s,
                                                      latent_bytes=1 if code else 2)
            tiles = (f"bs{t.block_s} m{t.block_m} r{t.block_r} w{t.num_warps} "
                     f"st{t.num_stages} splits{t.num_splits}"
                     f"{' bf16p' if t.q_dtype_partials else ''}")
            guarded(f"ours {kind} {name} {shape}", measure, f"ours {name} ({tiles})", kind, fn,
                    args, check, nbytes, **extra)
        if s % PAGE == 0:  # the engine's form: the same latents as shuffled pages of 64
            guarded(f"ours paged {kind} {shape}", measure, f"ours paged (pages of {PAGE})",
                    kind, *paged_args(args, b, s, sm_scale, interpret), check, nbytes, **extra)
        del args
    if tune and not quick:  # the merge alone at the default tiling: its share of the call
        splits = pk.MLABlockSizes().resolve(b, HEADS, RANK, s).num_splits
        for partials in (False, True) if splits > 1 else ():
            want = merge_only(b, splits, partials)[0](*merge_only(b, splits, partials)[1][0])
            for first in (False, True):
                fn, margs, mbytes = merge_only(b, splits, partials, first)
                guarded(f"merge {shape}", measure,
                        f"merge only{' (weights first)' if first else ''}, splits{splits} "
                        f"{'bf16' if partials else 'f32'} partials", "bf16", fn, margs,
                        lambda out, want=want: rel_err(out, want), mbytes)
    del sets


def table(rows: list[dict]) -> str:
    lines = ["| shape | latent | impl | ms | TB/s read | of 4.8 | of 4.27 | err | err vs bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("part") == "time":
            vs = r.get("err_vs_bf16_latent")
            lines.append(f"| {r['shape']} | {r['kind']} | {r['impl']} | {r['ms']:.4f} | "
                         f"{r['latent_tbs']:.3f} | {r['frac_4_8']:.1%} | {r['frac_4_27']:.1%} "
                         f"| {r['err']:.1e}{'' if r['ok'] else ' BAD'} | "
                         f"{'' if vs is None else f'{vs:.1e}'} |")
    best = {}
    for r in rows:
        if r.get("part") == "time" and r["impl"].startswith("ours") and r["ok"]:
            key = (r["shape"], r["kind"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
    lines.append("")
    for (shape, kind), r in best.items():
        peers = {f"{p['impl']} {p['kind']}": p["ms"] for p in rows if p.get("part") == "time"
                 and p["shape"] == shape and p["impl"].startswith("xla")
                 and p["kind"] in (kind, "bf16")}
        base = best.get((shape, "bf16"))
        vs = ", ".join(f"{ms / r['ms']:.2f}x {name}" for name, ms in peers.items())
        if base is not None and kind != "bf16":
            vs += f", {base['ms'] / r['ms']:.2f}x our best bf16"
        lines.append(f"best {shape} {kind}: {r['impl']} {r['latent_tbs']:.3f} TB/s "
                     f"({r['frac_4_8']:.1%} of 4.8); {vs}")
    b = next((r for r in rows if r.get("part") == "bytes"), None)
    if b:
        lines.append(f"latent bytes per token per layer: bf16 {b['latent_bytes_per_token']}, "
                     f"int8 / fp8 {b['int8_bytes_per_token']} (576 codes + 2 float32 scales), "
                     f"vs MHA {b['mha_bytes_per_token']} ({b['mha_over_latent']:.1f}x the bf16 "
                     f"latent)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the JSON lines to this file")
    ap.add_argument("--quick", action="store_true", help="a tiny shape; on CPU in interpret mode")
    ap.add_argument("--shapes", default=None, help="BxS,... (default: all)")
    ap.add_argument("--kinds", default="bf16,int8,fp8",
                    help="latent kinds, of bf16, int8, fp8 (default: all three)")
    ap.add_argument("--tune", action="store_true",
                    help="also the bf16 tuning candidates and the merge alone")
    ap.add_argument("--budget", type=float, default=None, metavar="S",
                    help="start no new shape after S seconds (the table still prints)")
    args = ap.parse_args(argv)
    kinds = tuple(args.kinds.split(","))
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"--kinds takes {', '.join(KINDS)}; got {', '.join(bad)}")
    dev = jax.devices()[0]
    interpret = dev.platform != "gpu"
    if interpret and not args.quick:
        print("no GPU: run with --quick (interpret mode, a tiny shape)")
        return 1
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}", flush=True)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        want = {tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")}
        shapes = tuple(sh for sh in shapes if sh in want)
    t0 = time.time()
    for b, s in shapes:
        if args.budget is not None and time.time() - t0 > args.budget:
            print(f"[budget of {args.budget:.0f}s spent: B{b} S{s} and later shapes skipped]")
            break
        guarded(f"mla B{b} S{s}", bench_shape, b, s, args.quick, interpret, kinds, args.tune)
        print(f"[B{b} S{s} done at {time.time() - t0:.0f}s]", flush=True)
        if args.json:  # after each shape, so a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in RESULTS)
    print("\n" + table(RESULTS))
    bad = [r for r in RESULTS if r.get("part") == "time" and not r["ok"]]
    failed = [r for r in RESULTS if "failed" in r]
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
