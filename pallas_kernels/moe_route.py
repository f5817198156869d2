"""A MoE layer's router at decode rows in one kernel: logits, scores, top-k, weights.

    moe_route(h, router, k=..., scoring="softmax", norm_topk_prob=..., scaling=1.0)
        h [N, D] (the normed stream), router [D, E] float32 -> (weights [N, k] float32,
        experts [N, k] int32, best first)

The same choice as transformers' routers without groups or a score bias (Mixtral, Qwen3-MoE,
DeepSeek-V2-Lite): scores = softmax (or sigmoid) of h @ router in float32, the k best
(the lowest index first among equal scores, as lax.top_k), their scores renormalised to sum
to 1 with norm_topk_prob, times `scaling`. XLA runs this as ~7 small launches a layer
(benchmarks/DECISIONS.md); here one program per row streams the router in chunks of D rows,
every product in float32 (no TF32), and picks the k best by repeated maxima.

    add_rms_norm_route(x, deltas, norm_weight, router, eps=..., k=..., ...)
        -> (x + sum(deltas), its RMSNorm h, weights, experts)

The sublayer's boundary (rms_norm.add_rms_norm: the residual add of a split-K producer's
chunks and the RMSNorm) and the router of its h in one launch: h is stored, then read back in
chunks by the router's loop.

blocks > 1 (either op): D in that many row blocks, each row's blocks in programs of their
own (a large router streamed by many SMs, not one), their float32 partial logits
[blocks, N, E] summed in block order by a second launch that picks. With the boundary, every
block's program sums the whole row's squares (rms_norm's scale) and stores its own rows of
x + sum(deltas) and h.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_array, next_pow2
from pallas_kernels.rms_norm import add_and_norm, add_rms_norm_reference, check_add

SCORINGS = ("softmax", "sigmoid")
_TILE = 8192  # router elements a chunk holds in registers ([chunk, Ep] float32)


def _logits(h_ref, w_ref, *, e: int, chunk: int, rows: int, start=0):
    """h_ref [Dp] @ w_ref [Dp, Ep] over D rows start .. start + rows in float32, streamed in
    chunks of D rows -> [Ep]."""
    ep = w_ref.shape[1]
    col_ok = jnp.arange(ep) < e

    def body(c, acc):  # acc [Ep] += h[c chunk] @ router[c chunk]
        r0 = start + c * chunk
        r = r0 + jnp.arange(chunk)  # [chunk]
        hc = plgpu.load(h_ref.at[pl.ds(r0, chunk)], mask=r < start + rows, other=0)
        wc = plgpu.load(w_ref.at[pl.ds(r0, chunk), :],
                        mask=(r < start + rows)[:, None] & col_ok[None, :], other=0)
        return acc + jnp.sum(hc.astype(jnp.float32)[:, None] * wc, axis=0)  # wc [chunk, Ep]

    return lax.fori_loop(0, pl.cdiv(rows, chunk), body, jnp.zeros((ep,), jnp.float32))


def _pick(logits, wo_ref, eo_ref, *, e: int, k: int, scoring: str, norm_topk_prob: bool,
          scaling: float):
    """Scores of logits [Ep], the k best (lowest index among equals), stored to wo_ref and
    eo_ref [Kp]."""
    ep = logits.shape[0]
    col = jnp.arange(ep)  # [Ep]
    col_ok = col < e
    if scoring == "softmax":
        z = jnp.where(col_ok, logits, -jnp.inf)
        p = jnp.exp(z - jnp.max(z))
        scores = p / jnp.sum(p)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = jnp.where(col_ok, scores, -jnp.inf)
    kp = wo_ref.shape[0]
    slot = jnp.arange(kp)
    weights, experts = jnp.zeros((kp,), jnp.float32), jnp.zeros((kp,), jnp.int32)
    for j in range(k):  # the j-th best: the largest score left, its lowest index
        best = jnp.max(choice)
        idx = jnp.min(jnp.where(choice == best, col, ep))
        picked = col == idx
        weights = jnp.where(slot == j, jnp.sum(jnp.where(picked, scores, 0.0)), weights)
        experts = jnp.where(slot == j, idx, experts)
        choice = jnp.where(picked, -jnp.inf, choice)
    if norm_topk_prob:
        total = jnp.sum(jnp.where(slot < k, weights, 0.0))
        weights = weights / (total + 1e-20 if scoring == "sigmoid" else total)
    plgpu.store(wo_ref, weights * scaling, mask=slot < k)
    plgpu.store(eo_ref, experts, mask=slot < k)


def _route_kernel(h_ref, w_ref, wo_ref, eo_ref, *, d: int, e: int, chunk: int, **pick):
    # h_ref [Dp] (a row); w_ref [Dp, Ep] (Dp, Ep: powers of two >= D, E; masked past them);
    # wo_ref, eo_ref [Kp] (the row's)
    _pick(_logits(h_ref, w_ref, e=e, chunk=chunk, rows=d), wo_ref, eo_ref, e=e, **pick)


def _add_norm_route_kernel(*refs, splits: int, eps: float, interpret: bool, d: int, e: int,
                           chunk: int, **pick):
    # refs: `splits` delta refs [Dp] (the row of each chunk), x_ref [Dp], nw_ref [Dp] (the
    # norm's weight), w_ref [Dp, Ep]; outputs xo_ref, h_ref [Dp], wo_ref, eo_ref [Kp]
    d_refs, (x_ref, nw_ref, w_ref, xo_ref, h_ref, wo_ref, eo_ref) = refs[:splits], \
        refs[splits:]
    ok = jnp.arange(x_ref.shape[0]) < d  # [Dp]
    add_and_norm(d_refs, x_ref, nw_ref, xo_ref, h_ref, ok, ok, dim=d, eps=eps)  # add_rms_norm's
    if not interpret:  # the router's chunks read h back: every thread's part stored first
        plgpu.debug_barrier()
    _pick(_logits(h_ref, w_ref, e=e, chunk=chunk, rows=d), wo_ref, eo_ref, e=e, **pick)


def _block_logits_kernel(*refs, splits: int, eps: float, interpret: bool, d: int, e: int,
                         chunk: int, rows: int):
    # grid (row i, block c): the row's logits over D rows c * rows .. -> lo_ref [Ep].
    # splits 0: refs h_ref [Dp], w_ref [Dp, Ep], lo_ref. splits > 0 (the boundary): `splits`
    # delta refs, x_ref, nw_ref [Dp], w_ref; outputs lo_ref, xo_ref, h_ref [Dp]: each block
    # sums the whole row's squares and stores its own rows of x + sum(deltas) and h, then
    # reads its h back (the stored bf16 values, as the router's reference takes them)
    c = pl.program_id(1)
    if not splits:
        h_ref, w_ref, lo_ref = refs
    else:
        d_refs, (x_ref, nw_ref, w_ref, lo_ref, xo_ref, h_ref) = refs[:splits], refs[splits:]
        col = jnp.arange(x_ref.shape[0])  # [Dp]
        add_and_norm(d_refs, x_ref, nw_ref, xo_ref, h_ref, col < d, col < d, dim=d, eps=eps,
                     store=(col >= c * rows) & (col < (c + 1) * rows))
        if not interpret:  # every thread's part of h stored before the loop reads it
            plgpu.debug_barrier()
    logits = _logits(h_ref, w_ref, e=e, chunk=chunk, rows=rows, start=c * rows)
    plgpu.store(lo_ref, logits)


def _sum_pick_kernel(*refs, e: int, **pick):
    # refs: a row's partial logits [Ep] of each block, summed in block order; wo_ref, eo_ref [Kp]
    *lo_refs, wo_ref, eo_ref = refs
    logits = plgpu.load(lo_refs[0])
    for lo_ref in lo_refs[1:]:
        logits += plgpu.load(lo_ref)
    _pick(logits, wo_ref, eo_ref, e=e, **pick)


def _validate(h, router, k: int, scoring: str, op: str = "moe_route", blocks: int = 1):
    check_array(op, "h", h, 2)
    check_array(op, "router", router, 2)
    if router.shape[0] != h.shape[1] or router.dtype != jnp.float32:
        raise ValueError(f"{op}: router must be float32 [D, E] with D = h's {h.shape[1]}, "
                         f"got {router.dtype} {tuple(router.shape)}")
    if not 1 <= k <= router.shape[1]:
        raise ValueError(f"{op}: k={k} must be in 1..E={router.shape[1]}")
    if scoring not in SCORINGS:
        raise ValueError(f"{op}: scoring must be one of {SCORINGS}, got {scoring!r}")
    d = router.shape[0]
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1 \
            or blocks & (blocks - 1) or d % blocks:
        raise ValueError(f"{op}: blocks={blocks!r} must be a power of two that divides D={d}")


def moe_route(h, router, *, k: int, scoring: str = "softmax", norm_topk_prob: bool = False,
              scaling: float = 1.0, blocks: int = 1, interpret: bool = False):
    """(weights [N, k] float32, experts [N, k] int32) of h [N, D] under router [D, E] float32
    (module docstring); one program per row, or per row and block of D (blocks > 1)."""
    _validate(h, router, k, scoring, blocks=blocks)
    pick = dict(k=int(k), scoring=scoring, norm_topk_prob=bool(norm_topk_prob),
                scaling=float(scaling), interpret=interpret)
    if blocks > 1:
        return _sum_pick(_block_logits(h, None, None, router, eps=0.0, blocks=blocks,
                                       interpret=interpret)[0], e=router.shape[1], **pick)
    return _route(h, router, **pick)


def _tiles(d: int, e: int, k: int):
    dp, ep, kp = next_pow2(d), next_pow2(e), next_pow2(k)
    return dp, ep, kp, min(dp, max(16, _TILE // ep))  # ..., the chunk of D rows a step


@functools.partial(jax.jit, static_argnames=("k", "scoring", "norm_topk_prob", "scaling",
                                             "interpret"))
def _route(h, router, *, k, scoring, norm_topk_prob, scaling, interpret):
    n, d = h.shape
    e = router.shape[1]
    dp, ep, kp, chunk = _tiles(d, e, k)
    kernel = functools.partial(_route_kernel, d=d, e=e, k=k, chunk=chunk, scoring=scoring,
                               norm_topk_prob=norm_topk_prob, scaling=scaling)
    return pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[pl.BlockSpec((None, dp), lambda i: (i, 0)),
                  pl.BlockSpec((dp, ep), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((n, k), jnp.float32),
                   jax.ShapeDtypeStruct((n, k), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(h, router)


@functools.partial(jax.jit, static_argnames=("eps", "blocks", "interpret"))
def _block_logits(x, norm_weight, deltas, router, *, eps, blocks, interpret):
    """The partial logits [blocks, N, Ep] of the rows x [N, D] (deltas None: x is h), or of
    the RMSNorm of x + sum(deltas) under norm_weight (then also x_new, h: [N, D])."""
    norm = deltas is not None
    n, d = x.shape
    e = router.shape[1]
    dp, ep, _, chunk = _tiles(d, e, 1)
    rows = d // blocks
    chunk = min(chunk, next_pow2(rows))
    s = deltas.shape[0] if norm else 0
    kernel = functools.partial(_block_logits_kernel, splits=s, eps=eps, interpret=interpret,
                               d=d, e=e, chunk=chunk, rows=rows)
    row = pl.BlockSpec((None, dp), lambda i, c: (i, 0))
    logits = pl.BlockSpec((None, None, ep), lambda i, c: (c, i, 0))
    out_shape = [jax.ShapeDtypeStruct((blocks, n, ep), jnp.float32)]
    in_specs, args, out_specs = [row], [x], [logits]
    if norm:
        h_dtype = jnp.result_type(norm_weight.dtype, x.dtype)
        in_specs = [*[pl.BlockSpec((None, None, dp), lambda i, c, j=j: (j, i, 0))
                      for j in range(s)], row, pl.BlockSpec((dp,), lambda i, c: (0,))]
        args = [*[deltas] * s, x, norm_weight]
        out_specs += [row, row]
        out_shape += [jax.ShapeDtypeStruct((n, d), x.dtype),
                      jax.ShapeDtypeStruct((n, d), h_dtype)]
    return pl.pallas_call(
        kernel,
        grid=(n, blocks),
        in_specs=[*in_specs, pl.BlockSpec((dp, ep), lambda i, c: (0, 0))],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm_route_blocks" if norm else "moe_route_blocks",
    )(*args, router)


@functools.partial(jax.jit, static_argnames=("e", "k", "scoring", "norm_topk_prob", "scaling",
                                             "interpret"))
def _sum_pick(partial_logits, *, e, k, scoring, norm_topk_prob, scaling, interpret):
    blocks, n, ep = partial_logits.shape
    kp = next_pow2(k)
    kernel = functools.partial(_sum_pick_kernel, e=e, k=k, scoring=scoring,
                               norm_topk_prob=norm_topk_prob, scaling=scaling)
    return pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[pl.BlockSpec((None, None, ep), lambda i, b=b: (b, i, 0))
                  for b in range(blocks)],
        out_specs=[pl.BlockSpec((None, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((n, k), jnp.float32),
                   jax.ShapeDtypeStruct((n, k), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="moe_route_pick",
    )(*[partial_logits] * blocks)


def add_rms_norm_route(x, deltas, norm_weight, router, *, eps: float, k: int,
                       scoring: str = "softmax", norm_topk_prob: bool = False,
                       scaling: float = 1.0, blocks: int = 1, interpret: bool = False):
    """The MoE sublayer's boundary and router in one kernel (two with blocks > 1): x [N, D] +
    sum(deltas [S, N, D]) and its RMSNorm h (as rms_norm.add_rms_norm), then moe_route of h.
    Returns (x_new [N, D] in x's dtype, h [N, D], weights [N, k] float32, experts [N, k]
    int32)."""
    check_add("add_rms_norm_route", x, deltas, norm_weight)
    _validate(x, router, k, scoring, "add_rms_norm_route", blocks)
    pick = dict(k=int(k), scoring=scoring, norm_topk_prob=bool(norm_topk_prob),
                scaling=float(scaling), interpret=interpret)
    if blocks > 1:
        logits, x_new, h = _block_logits(x, norm_weight, deltas, router, eps=float(eps),
                                         blocks=blocks, interpret=interpret)
        return (x_new, h, *_sum_pick(logits, e=router.shape[1], **pick))
    return _add_norm_route(x, deltas, norm_weight, router, eps=float(eps), **pick)


@functools.partial(jax.jit, static_argnames=("eps", "k", "scoring", "norm_topk_prob", "scaling",
                                             "interpret"))
def _add_norm_route(x, deltas, norm_weight, router, *, eps, k, scoring, norm_topk_prob,
                    scaling, interpret):
    n, d = x.shape
    s, e = deltas.shape[0], router.shape[1]
    dp, ep, kp, chunk = _tiles(d, e, k)
    kernel = functools.partial(_add_norm_route_kernel, splits=s, eps=eps, interpret=interpret,
                               d=d, e=e, k=k, chunk=chunk, scoring=scoring,
                               norm_topk_prob=norm_topk_prob, scaling=scaling)
    row = pl.BlockSpec((None, dp), lambda i: (i, 0))
    chunks = [pl.BlockSpec((None, None, dp), lambda i, c=c: (c, i, 0)) for c in range(s)]
    pick = pl.BlockSpec((None, kp), lambda i: (i, 0))
    h_dtype = jnp.result_type(norm_weight.dtype, x.dtype)
    return pl.pallas_call(
        kernel,
        grid=(n,),
        in_specs=[*chunks, row, pl.BlockSpec((dp,), lambda i: (0,)),
                  pl.BlockSpec((dp, ep), lambda i: (0, 0))],
        out_specs=[row, row, pick, pick],
        out_shape=[jax.ShapeDtypeStruct((n, d), x.dtype), jax.ShapeDtypeStruct((n, d), h_dtype),
                   jax.ShapeDtypeStruct((n, k), jnp.float32),
                   jax.ShapeDtypeStruct((n, k), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm_route",
    )(*([deltas] * s), x, norm_weight, router)


def moe_route_reference(h, router, *, k: int, scoring: str = "softmax",
                        norm_topk_prob: bool = False, scaling: float = 1.0, interpret=False):
    """The same in plain jnp (XLA's float32 product at full precision, lax.top_k)."""
    _validate(h, router, k, scoring)
    logits = jnp.dot(h.astype(jnp.float32), router, precision=lax.Precision.HIGHEST)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    weights, experts = lax.top_k(scores, k)
    if norm_topk_prob:
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if scoring == "sigmoid" else total)
    return weights * scaling, experts.astype(jnp.int32)


def add_rms_norm_route_reference(x, deltas, norm_weight, router, *, eps: float, k: int,
                                 scoring: str = "softmax", norm_topk_prob: bool = False,
                                 scaling: float = 1.0, interpret: bool = False):
    """The same in plain jnp: add_rms_norm_reference, then moe_route_reference of h."""
    x_new, h = add_rms_norm_reference(x, deltas, norm_weight, eps=eps)
    return (x_new, h, *moe_route_reference(h, router, k=k, scoring=scoring,
                                           norm_topk_prob=norm_topk_prob, scaling=scaling))
