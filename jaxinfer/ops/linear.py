"""The matmul ops: `embed`, `linear`, `norm_linear`, `lm_head` (and `norm`), over typed weights.

Every product goes through `matmul`, whose registry picks the fused small-M Pallas kernel on
the decode path (norm in its prologue, split-K chunks left for the consumer; with
batch_invariant every product, at one set of tiles per weight shape), or XLA's dot. The ops
around it own the
sublayer boundary (pallas_kernels/norm_matmul.py describes the fused boundary; the plan says
where it runs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxinfer.ops import blocked, reference
from jaxinfer.ops.dispatch import Registry, decode_path, kernels_on, rows
from jaxinfer.ops.stream import (ANY_SUM, ARRAY_ONLY, Deferred, Form, Partials, Projection,
                                 Residual)
from jaxinfer.plan import Boundary, Impl, Plan
from jaxinfer.weights import (Dense, Parts, QuantizedWeight, as_array, is_transposed,
                              kernel_operand)
from pallas_kernels._common import on_hopper, sum_chunks
from pallas_kernels.norm_matmul import default_block_sizes, first_rows_plan

# ---------------------------------------------------------------------------------------------
# Tiles and prefetch plans (both follow the consumer kernel's tiling)
# ---------------------------------------------------------------------------------------------


def tiles(plan: Plan, m: int, k: int, n: int, weights: int, dtype):
    """The fused matmul tiles for x [m, k] @ `weights` weights [k, n]: the policy's override,
    or with batch_invariant the small-M tiles of the weight's shape whatever m (block_m 16,
    the split of K from K and N only: a row's reduction order, its operand math and its
    chunks' sum are then the same at any M = B * T, decode or prefill); None: the kernel's
    own choice by shape."""
    policy = plan.policy
    override = policy.tiles(k, n, weights)
    if override is not None:
        return override
    if policy.batch_invariant:
        return default_block_sizes(16, n, k, jnp.dtype(dtype).itemsize, n_weights=weights)
    return None


def prefetch_pairs(prefetch, weights: tuple, m: int, plan: Plan) -> tuple:
    """(weight array, PrefetchPlan) pairs asking a producer kernel to prefetch the first rows of
    a decode consumer's weights (1, or SwiGLU's 2, [K, *N]) as the policy's `prefetch` says."""
    w = weights[0]
    if prefetch is None or not isinstance(w, Dense) or w.transposed:
        return ()
    k, n, itemsize = w.in_features, math.prod(w.out_shape), jnp.dtype(w.dtype).itemsize
    blocks = tiles(plan, m, k, n, len(weights), w.dtype)
    fp = first_rows_plan(m, k, n, itemsize=itemsize, n_weights=len(weights), rows=prefetch.rows,
                         at=prefetch.at.value, block_sizes=blocks)
    # Rows the instruction cannot address (not in 16-byte granules) get no prefetch.
    if any((s * itemsize) % 16 for s in (fp.length, *fp.starts)):
        return ()
    return tuple((wt.w, fp) for wt in weights)


# ---------------------------------------------------------------------------------------------
# The matmul core: (x [B, T, K], w) -> (x + sum(deltas), y [B, T, *N] in an accepted form)
# ---------------------------------------------------------------------------------------------

MATMUL = Registry("matmul")


def _weight_ok(w, x) -> str | None:
    """A Dense of the activations' dtype, or a QuantizedWeight (dequantized to x's dtype)."""
    if isinstance(w, QuantizedWeight):
        return None
    if not isinstance(w, Dense):
        return f"weight type {type(w).__name__}"
    if jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
        return f"weight dtype {w.dtype} differs from the activations' {x.dtype}"
    return None


def int_layout(plan: Plan) -> str:
    """The layout the plan's quantized matmuls read: "nk" (the Mosaic GPU kernel, for the
    weights pk.nk_unfit passes) or "tiles"."""
    policy = plan.policy
    if policy.quant_matmul == "auto":
        mosaic = (on_hopper() and not policy.interpret and not policy.batch_invariant
                  and not plan.sharded and kernels_on(plan, plan.config.dtype))
        return "nk" if mosaic else "tiles"
    return "nk" if policy.quant_matmul == "mosaic" else "tiles"


def _fused_supports(x, w, plan, *, deltas=None, **_) -> str | None:
    if (why := _weight_ok(w, x)) is not None:
        return why
    if isinstance(w, QuantizedWeight) and w.layout == "nk":
        return "codes laid out for the Mosaic GPU kernel (nk)"
    if not decode_path(x, plan):
        return "not the decode path (rows, query length, dtype or the plan)"
    if deltas is not None and not isinstance(deltas, Partials):
        return "deltas are not float32 chunks"
    return None


@MATMUL.register("fused_small_m", _fused_supports, kernel=True)
def _fused_small_m(x, w, plan, *, accept=ARRAY_ONLY, norm_w=None, eps=0.0, deltas=None,
                   bias=None, out_dtype=None, prefetch=()):
    """The decode matmul: one pass over the weight, the residual add and the norm in its
    main loop, split-K chunks left unreduced when the consumer sums them."""
    policy = plan.policy
    m, k = rows(x), x.shape[-1]
    n = math.prod(w.out_shape)
    want = Form.NORMED if norm_w is not None else Form.PARTIALS
    partials = (want in accept and bias is None and out_dtype is None
                and not is_transposed(w))
    dl = None if deltas is None else deltas.parts.reshape(deltas.parts.shape[0], m, k)
    # Batch-invariant: the one-row operand math at M = 1 reduces the norm's sums of squares
    # in another layout than at M > 1, so a norm finished here takes the row tiles; a
    # deferred one leaves the sums to the consumer (one input row per program).
    single_row = not (policy.batch_invariant and norm_w is not None and not partials)
    out = pk.norm_matmul(
        x.reshape(m, k), norm_w, kernel_operand(w), eps=eps, partials=partials, deltas=dl,
        prefetch=prefetch, transposed=is_transposed(w), out_dtype=out_dtype,
        single_row=single_row,
        interpret=policy.interpret,
        block_sizes=tiles(plan, m, k, n, 1, x.dtype))
    x_new = x
    if dl is not None:
        x_new, out = out
        x_new = x_new.reshape(x.shape)
    lead = x.shape[:-1]
    if partials:
        parts, ss = out if norm_w is not None else (out, None)
        parts = parts.reshape(parts.shape[0], *lead, *w.out_shape)  # [S, B, T, *N]
        if ss is None:
            return x_new, Partials(parts)
        if policy.batch_invariant:
            return x_new, Partials(parts, (x_new.reshape(m, k), eps))
        return x_new, Partials(parts, (ss, k, eps))
    y = out.reshape(*lead, *w.out_shape)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)
    return x_new, y


def _mosaic_int_supports(x, w, plan, **_) -> str | None:
    if not (isinstance(w, QuantizedWeight) and w.layout == "nk"):
        return "not a quantized weight in the nk layout"
    if not kernels_on(plan, x.dtype) or plan.sharded or jnp.dtype(x.dtype) != jnp.bfloat16:
        return "kernels off, a sharded plan or activations not bfloat16"
    if rows(x) > plan.policy.mosaic_int_rows:
        return (f"{rows(x)} rows (more than KernelPolicy.mosaic_int_rows = "
                f"{plan.policy.mosaic_int_rows})")
    return None


def mosaic_boundary(x_aval, w, plan: Plan, deltas=None) -> bool:
    """Whether the pre-norm boundary before nk weight(s) w runs in the Mosaic kernel's main
    loop for activations x_aval (at most KernelPolicy.mosaic_norm_rows rows)."""
    m = rows(x_aval)
    return (m <= plan.policy.mosaic_norm_rows and not plan.config.norm_offset
            and pk.nk_norm_unfit(m, w) is None
            and (deltas is None or (isinstance(deltas, Partials) and deltas.norm is None)))


@MATMUL.register("mosaic_int", _mosaic_int_supports, kernel=True, before="fused_small_m")
def _mosaic_int(x, w, plan, *, accept=ARRAY_ONLY, norm_w=None, eps=0.0, deltas=None,
                 bias=None, out_dtype=None, prefetch=()):
    """An nk weight (int4 / int8 / fp8, GGUF's block types) through the Mosaic GPU kernel.
    The boundary before it (deltas, the norm) in its main loop where mosaic_boundary says,
    the norm's scale then left to a consumer that takes NORMED chunks (attention); else in
    its own ops. Its K ranges' float32 sums go to a consumer that adds them where it accepts
    them (attention; the next boundary): no XLA sum between the kernels."""
    m, k = rows(x), x.shape[-1]
    if norm_w is not None and bias is None and mosaic_boundary(x, w, plan, deltas):
        dl = None if deltas is None else deltas.parts.reshape(deltas.parts.shape[0], m, k)
        normed = Form.NORMED in accept and out_dtype is None
        y, x_new, ss = pk.quantized_matmul_mgpu(
            x.reshape(m, k), w, interpret=plan.policy.interpret, out_dtype=out_dtype,
            partials=normed, norm_weight=norm_w, eps=eps, deltas=dl)
        if normed:  # [S, M, N] -> [S, B, T, *N]; ss [S, 8]: the first M columns the rows'
            return x_new.reshape(x.shape), Partials(
                y.reshape(y.shape[0], *x.shape[:-1], *w.out_shape), (ss, k, eps))
        return x_new.reshape(x.shape), y.reshape(*x.shape[:-1], *w.out_shape)
    x = add_deltas(x, deltas)
    h = x if norm_w is None else norm(x, norm_w, eps, plan)
    partials = Form.PARTIALS in accept and bias is None and out_dtype is None
    y = pk.quantized_matmul_mgpu(h.reshape(m, k), w, interpret=plan.policy.interpret,
                                 out_dtype=jnp.float32 if bias is not None else out_dtype,
                                 partials=partials)
    if partials:  # [S, M, N] -> [S, B, T, *N]
        return x, Partials(y.reshape(y.shape[0], *h.shape[:-1], *w.out_shape))
    y = y.reshape(*h.shape[:-1], *w.out_shape)
    if bias is not None:
        y = (y + bias.astype(jnp.float32)).astype(out_dtype or h.dtype)
    return x, y


@MATMUL.register("xla", lambda x, w, plan, **_: _weight_ok(w, x))
def _xla(x, w, plan, *, accept=ARRAY_ONLY, norm_w=None, eps=0.0, deltas=None, bias=None,
         out_dtype=None, prefetch=()):
    x = add_deltas(x, deltas)
    h = x if norm_w is None else reference.rms_norm(x, norm_w, eps)
    if isinstance(w, QuantizedWeight):  # a tile at a time where the plan says (the CPU)
        return x, blocked.linear(h, w, plan, bias, out_dtype)
    return x, reference.linear(h, as_array(w, h.dtype), bias, transposed=is_transposed(w),
                               out_dtype=out_dtype)


@MATMUL.register("parts", lambda x, w, plan, **_: None if isinstance(w, Parts)
                 else "not a Parts weight", before="fused_small_m")
def _parts(x, w, plan, *, accept=ARRAY_ONLY, norm_w=None, eps=0.0, deltas=None, bias=None,
           out_dtype=None, prefetch=()):
    """A weight of parts of different layouts: the boundary once, then one matmul per part
    (each through its own best implementation), their outputs interleaved as w.combine says."""
    x = add_deltas(x, deltas)
    h = x if norm_w is None else norm(x, norm_w, eps, plan)
    ys = [matmul(h, p, plan, out_dtype=jnp.float32)[1] for p in w.parts]
    y = w.combine(ys)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return x, y.astype(out_dtype or x.dtype)


def matmul(x, w, plan: Plan, **kwargs):
    """(x + sum(deltas), [rms_norm](x + sum(deltas)) @ w (+ bias)) through the first
    implementation that takes them. x [B, T, K]; keywords: accept (the output forms the
    caller takes; ARRAY always), norm_w [K] and eps, deltas (Partials of [B, T, K]), bias,
    out_dtype, prefetch (the consumer's weights, for the kernel's L2 prefetch)."""
    return MATMUL(x, w, plan, **kwargs)


def add_deltas(x, delta):
    """x + delta (an array, Partials summed in float32 with x and rounded once, or None)."""
    if delta is None:
        return x
    if isinstance(delta, Partials):
        return (sum_chunks(delta.parts) + x.astype(jnp.float32)).astype(x.dtype)
    return x + delta


# ---------------------------------------------------------------------------------------------
# Norms and the sublayer boundary
# ---------------------------------------------------------------------------------------------


def norm(x, weight, eps: float, plan: Plan):
    """HF RMSNorm over x's last axis: the Pallas kernel on the decode path (one launch, not
    XLA's two; every x of a batch-invariant plan: fixed per-row arithmetic), else the
    reference.
    A config with a norm_offset (Gemma's 1 + w, in float32) always takes the reference, and
    so does a sharded plan (XLA partitions it; the decode path is off there, dispatch.py)."""
    if plan.config.norm_offset or plan.sharded:
        return reference.rms_norm(x, weight, eps, plan.config.norm_offset)
    if decode_path(x, plan):
        return pk.rms_norm(x, weight, eps=eps, interpret=plan.policy.interpret)
    return reference.rms_norm(x, weight, eps)


def boundary(x, delta, weight, eps: float, plan: Plan, where: Boundary):
    """The pre-norm boundary on its own: (x + delta, rms_norm(x + delta)). Partials go to
    the add_rms_norm kernel unless the plan puts the boundary in XLA."""
    if isinstance(delta, Partials) and where is not Boundary.XLA and kernels_on(plan, x.dtype) \
            and not plan.config.norm_offset:
        return pk.add_rms_norm(x, delta.parts, weight, eps=eps, interpret=plan.policy.interpret)
    x = add_deltas(x, delta)
    return x, norm(x, weight, eps, plan)


def _dead_buffer(delta, m: int, d: int):
    """A consumed one-chunk float32 output [1, B, T, D] as a reusable [M, D] buffer."""
    if isinstance(delta, Partials) and delta.parts.shape[0] == 1 and delta.norm is None \
            and delta.parts.dtype == jnp.float32 and delta.parts.size == m * d:
        return delta.parts.reshape(m, d)
    return None


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------


def _embed_supports(table, tokens, plan) -> str | None:
    return None if isinstance(table, Dense) and table.transposed else "not a [V, D] Dense table"


EMBED = Registry("embed")
EMBED.register("gather", _embed_supports)(lambda table, tokens, plan: table.w[tokens])


@EMBED.register("quantized_columns",
                lambda table, tokens, plan: None if isinstance(table, QuantizedWeight)
                else "not quantized")
def _quantized_embed(table, tokens, plan):
    """A quantized table is [D, V] (the LM head's orientation): the tokens' columns of its
    codes and scales, dequantized -> [B, T, D] in the model's dtype."""
    flat = tokens.reshape(-1)
    cols = table.map_columns(lambda a: jnp.take(a, flat, axis=1)).replace(
        out_shape=(flat.shape[0],))
    return as_array(cols, plan.config.dtype).T.reshape(*tokens.shape, table.k)


def embed(table, tokens: jax.Array, plan: Plan) -> jax.Array:
    """Rows of the embedding table [V, D] for tokens [B, T] -> [B, T, D]."""
    return EMBED(table, tokens, plan)


def _post_norm(delta, weight, *, plan: Plan):
    return norm(delta, weight, plan.config.rms_norm_eps, plan)


def post_norm_of(weight, plan: Plan) -> tuple | None:
    """A Residual's post_norm for a sandwich-norm weight [D] (None: no post norm)."""
    return None if weight is None else (functools.partial(_post_norm, plan=plan), weight)


def linear(x, w, plan: Plan, *, bias=None, into: Residual | None = None, post_norm=None):
    """x [B, T, K] @ w (+ bias) -> [B, T, *N]. With `into`, the product is a sublayer's output
    for the residual stream instead: it returns `into` with the product pending, emitted when
    the next op (its consumer) takes it, in the form that op adds fastest. post_norm [D]: a
    sandwich RMSNorm the pending product goes through before it is added (Gemma)."""
    if into is None:
        return matmul(x, w, plan, bias=bias)[1]

    def emit(accept, prefetch):
        return (matmul(x, w, plan, accept=accept, bias=bias, prefetch=prefetch)[1],)
    return into.with_pending(Deferred(emit).part(0), post_norm_of(post_norm, plan))


def norm_linear(stream: Residual, norm_weight, w, plan: Plan, *, bias=None):
    """The pre-norm boundary and the matmul after it: x + pending -> (that stream,
    rms_norm(x + pending) @ w (+ bias) as a Projection [B, T, *N]). On the fused decode path,
    with the boundary in the consumer, one kernel adds the pending chunks, gathers the norm's
    statistics and streams w, and the norm's scale is left to the consumer (attend)."""
    policy, eps = plan.policy, plan.config.rms_norm_eps
    aval = stream.aval
    picked = MATMUL.pick(aval, w, plan).name
    fused = picked == "fused_small_m"
    hints = prefetch_pairs(policy.prefetch_norm_linear, (w,), rows(aval), plan) if fused else ()
    m, d = rows(aval), aval.shape[-1]

    def emit(accept, prefetch):
        x, delta = stream.take(ANY_SUM, hints)
        in_kernel = ((fused or (picked == "mosaic_int" and mosaic_boundary(aval, w, plan, delta)))
                     and policy.norm_linear_boundary is Boundary.CONSUMER and bias is None
                     and not plan.config.norm_offset
                     and (delta is None or isinstance(delta, Partials)))
        if in_kernel:
            x_new, y = matmul(x, w, plan, accept=accept, norm_w=norm_weight, eps=eps,
                              deltas=delta, prefetch=prefetch)
        else:
            x_new, h = boundary(x, delta, norm_weight, eps, plan, policy.norm_linear_boundary)
            _, y = matmul(h, w, plan, accept=accept, bias=bias, prefetch=prefetch)
        return x_new, y, _dead_buffer(delta, m, d)

    call = Deferred(emit)
    out = Residual(call.part(0), aval, spare=stream.spare, dead=call.part(2))
    return out, Projection(call.part(1), (*aval.shape[:-1], *w.out_shape), aval.dtype)


def lm_head(stream: Residual, norm_weight, head, plan: Plan, *, rows_at=None,
            hidden: bool = False):
    """The final boundary and the logits: rms_norm(x + pending) @ head -> float32
    [B, T, V], or [B, 1, V] at rows_at [B] (one position per row, e.g. a prompt's last).
    head: the LM head [D, V], or the tied embedding table [V, D].
    hidden=True -> (logits, h): also the normed stream h [B, T, D] of every position (what
    the head reads: the feature speculative drafters take); the norm then runs on its own,
    never fused into the head's matmul (h must exist)."""
    policy, eps = plan.policy, plan.config.rms_norm_eps
    b, t, d = stream.aval.shape
    sel = jax.ShapeDtypeStruct((b, 1 if rows_at is not None else t, d), stream.aval.dtype)
    # A quantized head always takes the kernel on the decode path: XLA would dequantize the
    # whole [D, V] table every step.
    picked = (MATMUL.pick(sel, head, plan).name
              if policy.lm_head is Impl.PALLAS or isinstance(head, QuantizedWeight) else None)
    pallas = picked in ("fused_small_m", "mosaic_int")
    x, delta = stream.take(ANY_SUM)
    if hidden:
        _, h = boundary(x, delta, norm_weight, eps, plan, policy.lm_head_boundary)  # [B, T, D]
        rows = h if rows_at is None else jnp.take_along_axis(h, rows_at[:, None, None], axis=1)
        impl = matmul if pallas else MATMUL.get("xla").run
        return impl(rows, head, plan, out_dtype=jnp.float32)[1], h
    if rows_at is not None:
        x = jnp.take_along_axis(x, rows_at[:, None, None], axis=1)  # [B, 1, D]
        if isinstance(delta, Partials):
            delta = Partials(jnp.take_along_axis(delta.parts, rows_at[None, :, None, None],
                                                 axis=2))
        elif delta is not None:
            delta = jnp.take_along_axis(delta, rows_at[:, None, None], axis=1)
    if pallas and picked == "fused_small_m" and policy.lm_head_boundary is Boundary.CONSUMER \
            and not plan.config.norm_offset and (delta is None or isinstance(delta, Partials)):
        return matmul(x, head, plan, norm_w=norm_weight, eps=eps, deltas=delta,
                      out_dtype=jnp.float32)[1]
    _, h = boundary(x, delta, norm_weight, eps, plan, policy.lm_head_boundary)
    if pallas:
        return matmul(h, head, plan, out_dtype=jnp.float32)[1]
    return MATMUL.get("xla").run(h, head, plan, out_dtype=jnp.float32)[1]
