"""Absorbed MLA decode attention (pallas_kernels/mla.py) vs XLA, in one run: checks, then speed.

    PYTHONPATH=. python3 benchmarks/mla.py --json out.jsonl       # the H200: DeepSeek-V2-Lite
    PYTHONPATH=. python3 benchmarks/mla.py --quick                # any CPU: a tiny shape, interpret

DeepSeek-V2-Lite attention shapes (H 16, R = kv_lora_rank 512, Dr = qk_rope_head_dim 64,
qk_nope 128, v_head 128), bf16, one new token per sequence, every cache slot valid: B in
{8, 32} x S in {4096, 8192}, and B = 1 at S = 32768. Per shape, in one call:

- ours: `mla_decode_attention` with its default block sizes and a few variants (tile, warps,
  stages, splits, an R split), so one run says which is best;
- xla absorbed: `mla_decode_attention_reference` compiled by XLA (the same math in einsums);
- xla expanded: the non-absorbed path: K = [c_KV @ W_UK ; k_rope], V = c_KV @ W_UV per head,
  then ordinary attention (what decode costs when the latent cache is expanded every step).

Each is checked against the reference in the same call (relative error, bf16 tolerance 1.5e-2;
the expanded path's output is compared with the reference's output @ W_UV). Reported: ms, the
latent bytes read per second (B x S x 576 x 2 bytes / time, TB/s), its fraction of 4.8 TB/s
(the H200's HBM) and of 4.27 TB/s (the measured copy the other benchmarks use), and the
latent bytes per token against the MHA equivalent (16 x (192 + 128) x 2). Timing is
benchmarks/kernels.py's (warm-up outside, median of repeats, inputs rotated when they fit in
L2, short calls chained in one program). JSON lines (stdout and --json), then a table.
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

HBM_TBS = 4.8  # the H200's HBM3e bandwidth (the issue's floor)
TOL_BF16 = 1.5e-2
# DeepSeek-V2-Lite: heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
HEADS, RANK, ROPE, NOPE, VDIM = 16, 512, 64, 128, 128
# the targets first, so a run cut short by its timeout still has them
SHAPES = ((8, 4096), (32, 8192), (1, 32768), (8, 8192), (32, 4096))
QUICK_SHAPES = ((2, 200),)

RESULTS: list[dict] = []


def variants(quick: bool) -> list[tuple[str, pk.MLABlockSizes | None]]:
    """(name, block sizes) of our kernel, the default first; splits variants are added per
    shape (`split_variants`)."""
    if quick:
        return [("default", None), ("bs16 R256", pk.MLABlockSizes(block_s=16, block_r=256)),
                ("splits3", pk.MLABlockSizes(num_splits=3)),
                ("splits3 bf16 partials", pk.MLABlockSizes(num_splits=3, q_dtype_partials=True))]
    mb = pk.MLABlockSizes
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


def bench_shape(b: int, s: int, quick: bool, interpret: bool) -> None:
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
    absorbed_args = [(q, lat, lengths) for q, lat, _, _ in sets]
    ref_fn = jax.jit(lambda q, lat, n: pk.mla_decode_attention_reference(q, lat, n,
                                                                         sm_scale=sm_scale))
    ref = ref_fn(*absorbed_args[0])  # [B, 1, H, R]
    ref_v = jnp.einsum("bhr,rhd->bhd", ref[:, 0].astype(jnp.float32), w_uv.astype(jnp.float32))
    iters = 2 if interpret else iters_for(latent_bytes / 3e12)
    repeats = 1 if interpret else 5
    emit(dict(part="bytes", shape=shape, latent_bytes_per_token=d * 2,
              mha_bytes_per_token=HEADS * (NOPE + ROPE + VDIM) * 2,
              mha_over_latent=HEADS * (NOPE + ROPE + VDIM) / d))

    def measure(impl, fn, args, check):
        err = check(fn(*args[0]))
        secs = time_fn(fn, args, iters=iters, repeats=repeats)
        tbs = latent_bytes / secs / 1e12
        return emit(dict(part="time", shape=shape, b=b, s=s, impl=impl, ms=secs * 1e3,
                         latent_tbs=tbs, frac_4_8=tbs / HBM_TBS, frac_4_27=tbs / PEAK_TBS,
                         err=err, ok=bool(err < TOL_BF16)))

    check_absorbed = lambda out: rel_err(out, ref)  # noqa: E731
    guarded(f"xla absorbed {shape}", measure, "xla absorbed", ref_fn, absorbed_args,
            check_absorbed)
    expanded = jax.jit(lambda qn, qr, lat, n: expanded_attention(qn, qr, lat, n, w_uk, w_uv,
                                                                 sm_scale))
    guarded(f"xla expanded {shape}", measure, "xla expanded", expanded,
            [(qn, qr, lat, lengths) for _, lat, qn, qr in sets], lambda out: rel_err(out, ref_v))
    for name, blocks in variants(quick) + ([] if quick else split_variants(b, s)):
        fn = jax.jit(lambda q, lat, n, blocks=blocks: pk.mla_decode_attention(
            q, lat, n, sm_scale=sm_scale, block_sizes=blocks, interpret=interpret))
        t = (blocks or pk.MLABlockSizes()).resolve(b, HEADS, RANK, s)
        tiles = (f"bs{t.block_s} m{t.block_m} r{t.block_r} w{t.num_warps} st{t.num_stages} "
                 f"splits{t.num_splits}{' bf16p' if t.q_dtype_partials else ''}")
        guarded(f"ours {name} {shape}", measure, f"ours {name} ({tiles})", fn, absorbed_args,
                check_absorbed)
    del sets, absorbed_args


def table(rows: list[dict]) -> str:
    lines = ["| shape | impl | ms | latent TB/s | of 4.8 | of 4.27 | err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("part") == "time":
            lines.append(f"| {r['shape']} | {r['impl']} | {r['ms']:.4f} | {r['latent_tbs']:.3f}"
                         f" | {r['frac_4_8']:.1%} | {r['frac_4_27']:.1%} | {r['err']:.1e}"
                         f"{'' if r['ok'] else ' BAD'} |")
    best = {}
    for r in rows:
        if r.get("part") == "time" and r["impl"].startswith("ours") and r["ok"]:
            if r["shape"] not in best or r["ms"] < best[r["shape"]]["ms"]:
                best[r["shape"]] = r
    lines.append("")
    for shape, r in best.items():
        peers = {p["impl"]: p["ms"] for p in rows if p.get("part") == "time"
                 and p["shape"] == shape and p["impl"].startswith("xla")}
        vs = ", ".join(f"{ms / r['ms']:.2f}x {name}" for name, ms in peers.items())
        lines.append(f"best {shape}: {r['impl']} {r['latent_tbs']:.3f} TB/s "
                     f"({r['frac_4_8']:.1%} of 4.8); {vs}")
    b = next((r for r in rows if r.get("part") == "bytes"), None)
    if b:
        lines.append(f"latent bytes per token per layer {b['latent_bytes_per_token']} vs MHA "
                     f"{b['mha_bytes_per_token']} ({b['mha_over_latent']:.1f}x fewer)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="also write the JSON lines to this file")
    ap.add_argument("--quick", action="store_true", help="a tiny shape; on CPU in interpret mode")
    ap.add_argument("--shapes", default=None, help="BxS,... (default: all)")
    args = ap.parse_args(argv)
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
        guarded(f"mla B{b} S{s}", bench_shape, b, s, args.quick, interpret)
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
