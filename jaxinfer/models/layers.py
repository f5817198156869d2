"""Layers shared by every model family: norms, RoPE, attention, MLP, and the parameter declaration.

Each function is pure over arrays. The attention entry point here is the one place that picks
a Pallas kernel (on GPU) or the pure-jnp reference (on CPU).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.configs import Config

# ---------------------------------------------------------------------------------------------
# Parameter declaration: shape + logical axes + initializer, declared once per weight.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, mapped to mesh axes in jaxinfer/sharding.py
    init: str = "normal"  # "normal" (std 0.02 / fan-in scaled), "ones", "zeros"

    def initialize(self, key: jax.Array, dtype) -> jax.Array:
        if self.init == "ones":
            return jnp.ones(self.shape, dtype)
        if self.init == "zeros":
            return jnp.zeros(self.shape, dtype)
        std = 1.0 / math.sqrt(self.shape[0]) if len(self.shape) >= 2 else 0.02  # fan-in first
        return (std * jax.random.normal(key, self.shape, jnp.float32)).astype(dtype)


def init_params(specs, key: jax.Array, dtype):
    """Random params with the declared shapes (benchmarks with `--random-weights`, tests)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda s: isinstance(s, ParamSpec))
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [s.initialize(k, dtype) for s, k in zip(leaves, keys)])


def check_params(params, specs) -> None:
    """Raise ValueError naming every param whose presence or shape differs from the declaration."""
    want = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda s: isinstance(s, ParamSpec))}
    have = {jax.tree_util.keystr(p): a for p, a in jax.tree_util.tree_leaves_with_path(params)}
    problems = [f"missing {k} (expected shape {s.shape})" for k, s in want.items() if k not in have]
    problems += [f"unexpected {k}" for k in have if k not in want]
    problems += [f"{k} has shape {tuple(have[k].shape)}, expected {s.shape}"
                 for k, s in want.items() if k in have and tuple(have[k].shape) != s.shape]
    if problems:
        raise ValueError("params do not match the model config: " + "; ".join(problems[:10])
                         + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""))


# ---------------------------------------------------------------------------------------------
# Norms, MLP
# ---------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: statistics in float32, the weight multiplies the result in x's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w [K, *N] (+ b [*N]) -> [..., *N]; float32 accumulation, x's dtype out."""
    y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def use_kernels(dtype) -> bool:
    """Pallas kernels on GPU for 16-bit activations; the pure-jnp references elsewhere (decided
    at trace time). float32 stays on the references: the float32 Triton kernels compile and
    pass their GPU tests (2026-11-30, session 2), but they use IEEE float32 dots and have not
    been measured against XLA's float32 path."""
    return jax.default_backend() == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def decode_kernels(x: jax.Array) -> bool:
    """The fused small-M kernels (pallas_kernels/norm_matmul.py) for x [..., D]: on GPU, 16-bit,
    at most 16 rows (decode). They stream each weight once; at larger M XLA's GEMMs were faster
    on the H200 (B=64 step: 9.6 ms with XLA's, 13.3 with the fused matmuls at block_m 64)."""
    return use_kernels(x.dtype) and math.prod(x.shape[:-1]) <= 16


class Partials(NamedTuple):
    """A sublayer's output left as float32 partial sums parts [S, ..., N] (a split-K matmul's
    chunks): `add_norm` adds them to the residual stream in the same pass as the next norm."""
    parts: jax.Array


def norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """rms_norm; on the decode path the RMSNorm kernel (one launch instead of XLA's two)."""
    if decode_kernels(x):
        from pallas_kernels import rms_norm as rms_norm_kernel

        return rms_norm_kernel(x, weight, eps=eps)
    return rms_norm(x, weight, eps)


def project(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """linear(x, w, b); x [..., K], w [K, *N]. The fused matmul on the decode path."""
    if decode_kernels(x):
        from pallas_kernels import norm_matmul

        y = norm_matmul(x.reshape(-1, x.shape[-1]), None, w).reshape(*x.shape[:-1], *w.shape[1:])
        return y if b is None else (y.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)
    return linear(x, w, b)


# The decode matmuls' L2 prefetch of the next kernel's weight (pallas_kernels/l2_prefetch.py):
# for each consumer ("o", "mlp" = SwiGLU, "down", "qkv" = the next layer's q/k/v), None (off)
# or (rows, at): its producer's programs prefetch the first `rows` rows of each of its K
# chunks at the "start" or the "end" of their own stream.
# Trace-time switch (jit again after a change). Measured in the B=1 Llama-3-8B step on the
# H200 (profile_decode.py --prefetch, 2026-11-30, four calls on three machines, kernel time
# against the default run in the same call): SwiGLU prefetching down's first 128 rows at its
# start and down the next q/k/v's first 64 at its end: -22 to -27 us per step (3.962 ->
# 3.936-3.942 ms; 4.005 -> 3.978-3.983); SwiGLU runs 0.45 us and down 0.3 us faster per layer,
# q/k/v 0.3. Every other placement lost: o's and q/k/v's prefetches slow the producer more
# than they speed the consumer (o -> SwiGLU +1.1 us on o), a kernel's own rows at its start
# slow it, more rows for down (256, 512) or bulk prefetches give less; the decode attention
# kernel prefetching o's rows (commit 2d67d29) slows the attention more than o gains
# (benchmarks/NOTES.md run L).
PREFETCH = {"o": None, "mlp": None, "down": (128, "start"), "qkv": (64, "end")}
# A probe, off: the same producers touching one line in every 2 MiB page of the consumer's
# weights, "start" or "end" (l2_prefetch.page_plan), to warm address translations for
# ~1/16384 of the bytes. Measured (benchmarks/run_h200.sh prefetch, NOTES run M): no
# consistent gain (3.975-3.990 ms against the default's 3.979-3.987 on one machine).
PAGE_TOUCH = {"o": None, "mlp": None, "down": None, "qkv": None}


def next_prefetch(consumer: str, x: jax.Array, *weights: jax.Array) -> tuple:
    """The `prefetch=` pairs for a decode matmul on x [..., D] whose next kernel, `consumer`
    (a PREFETCH key), multiplies by weights (1, or SwiGLU's 2, each [K, *N]); () when that
    consumer's prefetch is off or there is no next weight."""
    if not weights or weights[0] is None:
        return ()
    from pallas_kernels.l2_prefetch import page_plan
    from pallas_kernels.norm_matmul import first_rows_plan

    k, n = weights[0].shape[0], math.prod(weights[0].shape[1:])
    itemsize = weights[0].dtype.itemsize
    pairs = ()
    if PREFETCH.get(consumer) is not None:
        rows, at = PREFETCH[consumer]
        plan = first_rows_plan(math.prod(x.shape[:-1]), k, n, itemsize=itemsize,
                               n_weights=len(weights), rows=rows, at=at)
        # Rows the instruction cannot address (not in 16-byte granules) get no prefetch.
        if all((s * itemsize) % 16 == 0 for s in (plan.length, *plan.starts)):
            pairs += tuple((w, plan) for w in weights)
    if PAGE_TOUCH.get(consumer) is not None and k * n * itemsize >= 128:
        plan = page_plan(k * n, itemsize, at=PAGE_TOUCH[consumer])
        pairs += tuple((w, plan) for w in weights)
    return pairs


def linear_delta(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
                 prefetch: tuple = ()):
    """x @ w (+ b) for a consumer that sums split-K chunks itself (`add_norm`, the fused decode
    attention); x [..., K], w [K, *N]. On the decode path the fused matmul's unreduced float32
    chunks (Partials [S, ..., *N]), else project(). prefetch: `next_prefetch` pairs (decode
    path only)."""
    if b is None and decode_kernels(x):
        from pallas_kernels import norm_matmul

        parts = norm_matmul(x.reshape(-1, x.shape[-1]), None, w, partials=True,
                            prefetch=prefetch)  # [S, M, *N]
        return Partials(parts.reshape(parts.shape[0], *x.shape[:-1], *w.shape[1:]))
    return project(x, w, b)


# Partials at a sublayer boundary: True runs pallas_kernels.add_rms_norm, one kernel for the
# chunks' sum, the residual add and the RMSNorm; False sums them with the residual in an XLA
# fusion, then runs the RMSNorm kernel. Measured in the B=1 Llama-3-8B step on the H200
# (profile_decode.py, 2026-11-30): 4.110 vs 4.164 ms/step (2.95 us per boundary vs 1.8 + 1.8).
FUSED_ADD_NORM = True


def add_norm(x: jax.Array, delta, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """The pre-norm decoder's sublayer boundary: (x + delta, rms_norm(x + delta)). delta is an
    array [..., D] in x's dtype, or Partials, whose chunks are summed in float32 with the
    residual and rounded once to x's dtype, or None (the first layer: (x, rms_norm(x)))."""
    if delta is None:
        return x, norm(x, weight, eps)
    if isinstance(delta, Partials):
        if FUSED_ADD_NORM:
            from pallas_kernels import add_rms_norm

            return add_rms_norm(x, delta.parts, weight, eps=eps)
        x = (jnp.sum(delta.parts, axis=0) + x.astype(jnp.float32)).astype(x.dtype)
    else:
        x = x + delta
    return x, norm(x, weight, eps)


# Where the decode path's sublayer boundaries (residual add + RMSNorm) run, by name, as
# (FUSED_ADD_NORM, SWIGLU_ADD_NORM, QKV_ADD_NORM): "xla" (XLA's add, the RMSNorm kernel),
# "kernel" (add_rms_norm), "swiglu" (the attention -> MLP one in the SwiGLU kernel),
# "consumers" (both in the consuming matmuls). For benchmarks and tests: set_boundaries.
BOUNDARY_MODES = {"xla": (False, False, False), "kernel": (True, False, False),
                  "swiglu": (True, True, False), "consumers": (True, True, True)}


def set_boundaries(mode: str) -> None:
    """Set the three boundary flags of this module to BOUNDARY_MODES[mode] (trace-time
    switches: jit again after a change)."""
    global FUSED_ADD_NORM, SWIGLU_ADD_NORM, QKV_ADD_NORM
    if mode not in BOUNDARY_MODES:
        raise ValueError(f"unknown boundary mode {mode!r}; one of {sorted(BOUNDARY_MODES)}")
    FUSED_ADD_NORM, SWIGLU_ADD_NORM, QKV_ADD_NORM = BOUNDARY_MODES[mode]


# The MLP -> next attention boundary on the decode path: True adds the MLP's Partials to the
# residual stream and norms inside the q/k/v matmul's main loop, whose chunks the attention
# kernel then scales by the norm's rsqrt (`norm_qkv`); False runs `add_norm` first.
# With SWIGLU_ADD_NORM (mode "consumers"), measured in the B=1 Llama-3-8B step on the H200
# (benchmarks/decode.py, one call, alternating, 2026-11-30): 4.055 / 4.040 ms/token against
# 4.113 / 4.088 with both boundaries as add_rms_norm kernels; at 32k context 5.286 vs 5.340.
# The step has 5 kernels per layer instead of 7; each consumer matmul pays ~1.5-2 us for the
# operand math in its main loop (benchmarks/sm_probe.py), each add_rms_norm kernel was ~2.9.
QKV_ADD_NORM = True


def norm_qkv(x: jax.Array, delta, weight: jax.Array, w: jax.Array, b: jax.Array | None,
             eps: float, *, next_w: jax.Array | None = None):
    """The attention input of a pre-norm layer on the fused decode path: x + delta -> (that
    residual stream, the q/k/v projection of its RMSNorm (`linear_delta`), the deferred norm
    or None). x [..., D]; delta as in `add_norm`; w [D, *N], b [*N] or None. With
    QKV_ADD_NORM (no bias) the projection is Partials [S, ..., *N] of (x * weight) @ w and
    the norm is (sums of squares [S, M], D, eps), for `decode_attention_qkv` to finish.
    next_w: the o projection's weight [H * hd, D], for the L2 prefetch (PREFETCH["o"])."""
    if (QKV_ADD_NORM and b is None and decode_kernels(x)
            and (delta is None or isinstance(delta, Partials))):
        from pallas_kernels import norm_matmul

        d = x.shape[-1]
        deltas = None if delta is None else delta.parts.reshape(delta.parts.shape[0], -1, d)
        out = norm_matmul(x.reshape(-1, d), weight, w, eps=eps, partials=True, deltas=deltas,
                          prefetch=next_prefetch("o", x, next_w))
        x_new, (parts, ss) = out if deltas is not None else (x.reshape(-1, d), out)
        parts = parts.reshape(parts.shape[0], *x.shape[:-1], *w.shape[1:])
        return x_new.reshape(x.shape), Partials(parts), (ss, d, eps)
    x, h = add_norm(x, delta, weight, eps)
    return x, linear_delta(h, w, b), None


# The attention -> MLP boundary on the decode path: True adds the attention's Partials to the
# residual stream and norms inside the SwiGLU kernel's main loop (`norm_mlp`), so the boundary
# has no kernel of its own; False runs `add_norm` first. (Measured with QKV_ADD_NORM above.)
SWIGLU_ADD_NORM = True


# The decode MLP as one kernel (pallas_kernels.swiglu_down: SwiGLU, then each program's rows
# of w_down, summed into a float32 accumulator by relaxed atomics, the programs' column tiles
# staggered) for decode batches of at most this many rows; 0: two kernels (SwiGLU, then the
# split-K down projection). Trace-time switch. Measured in the B=1 Llama-3-8B step on the H200
# (benchmarks/run_h200.sh mlp, 2026-11-30, NOTES run P): 82.4 us per layer against
# 55.9 + 28.7 for SwiGLU and down, kernel time 3.889 / 3.897 against 3.941 / 3.943 ms per
# step, wall 3.912 against 3.946 / 3.969. The atomics' order varies between runs, so the
# step's logits can differ in their last bits from run to run; set 0 for bitwise-repeatable
# decoding.
ONE_KERNEL_MLP_ROWS = 1
ONE_KERNEL_MLP_OPTS: dict = {}  # swiglu_down keyword options (block_d, down_prefetch), probes


def one_kernel_mlp(x: jax.Array, p: dict) -> bool:
    """Whether norm_mlp runs the MLP of x [..., D] as one kernel (ONE_KERNEL_MLP_ROWS)."""
    return (decode_kernels(x) and math.prod(x.shape[:-1]) <= ONE_KERNEL_MLP_ROWS
            and "b_gate" not in p and "b_down" not in p and x.shape[-1] % 16 == 0)


def norm_mlp(x: jax.Array, delta, p: dict, norm_weight: jax.Array,
             eps: float, *, next_w: jax.Array | None = None, zeroed=None, dead=None):
    """The MLP half of a pre-norm layer: x + delta -> (that residual stream, the MLP's output
    on its RMSNorm, for the next `add_norm`, a zeroed buffer or None). x [..., D]; delta as
    in `add_norm`. next_w: the next layer's q/k/v weight [D, *N] or None, for the L2 prefetch
    (PREFETCH["qkv"]).
    The one-kernel MLP (`one_kernel_mlp`) adds into a zeroed float32 [M, D] accumulator and
    zeroes a buffer its caller is done with, for the next layer's accumulator: `zeroed` is
    the previous call's third result (None: a fresh zeros), `dead` the previous call's MLP
    output (Partials) once its consumer (this layer's q/k/v) has read it (None: a fresh
    buffer). The third result is None on the other paths."""
    if (SWIGLU_ADD_NORM and isinstance(delta, Partials) and "b_gate" not in p
            and use_kernels(x.dtype)):
        from pallas_kernels import swiglu, swiglu_down

        d = x.shape[-1]
        parts = delta.parts.reshape(delta.parts.shape[0], -1, d)  # [S, M, D]
        if one_kernel_mlp(x, p):
            m = parts.shape[1]
            acc = zeroed if zeroed is not None else jnp.zeros((m, d), jnp.float32)
            spare = (dead.parts.reshape(m, d) if isinstance(dead, Partials)
                     and dead.parts.shape[0] == 1 and dead.parts.dtype == jnp.float32
                     else jnp.zeros((m, d), jnp.float32))
            x_new, acc, spare = swiglu_down(
                x.reshape(-1, d), p["w_gate"], p["w_up"], p["w_down"], acc, spare,
                norm_weight=norm_weight, eps=eps, deltas=parts,
                prefetch=next_prefetch("qkv", x, next_w), **ONE_KERNEL_MLP_OPTS)
            return x_new.reshape(x.shape), Partials(acc.reshape(1, *x.shape)), spare
        x_new, act = swiglu(x.reshape(-1, d), p["w_gate"], p["w_up"], norm_weight=norm_weight,
                            eps=eps, deltas=parts,
                            prefetch=next_prefetch("down", x, p["w_down"]))
        act = act.reshape(*x.shape[:-1], act.shape[-1])
        return x_new.reshape(x.shape), linear_delta(
            act, p["w_down"], p.get("b_down"), prefetch=next_prefetch("qkv", x, next_w)), None
    x, h = add_norm(x, delta, norm_weight, eps)
    return x, mlp_delta(h, p), None


def swiglu_act(x: jax.Array, p: dict) -> jax.Array:
    """silu(x @ gate + b) * (x @ up + b); x [..., D] -> [..., F]. On GPU (16-bit, no biases)
    one kernel: gate and up in one pass over x, SiLU*up in the epilogue."""
    if use_kernels(x.dtype) and "b_gate" not in p:
        from pallas_kernels import swiglu

        return swiglu(x.reshape(-1, x.shape[-1]), p["w_gate"], p["w_up"]).reshape(
            *x.shape[:-1], p["w_gate"].shape[1])
    return jax.nn.silu(linear(x, p["w_gate"], p.get("b_gate"))) * linear(x, p["w_up"], p.get("b_up"))


def mlp_delta(x: jax.Array, p: dict):
    """The MLP sublayer's output for `add_norm` (Partials on the decode path)."""
    return linear_delta(swiglu_act(x, p), p["w_down"], p.get("b_down"))


# ---------------------------------------------------------------------------------------------
# RoPE (HF rotate-half convention) and its scaling variants
# ---------------------------------------------------------------------------------------------


def rope_frequencies(config: Config) -> tuple[np.ndarray, float]:
    """Static inverse frequencies [rotary_dim / 2] (float32) and the cos/sin attention factor.

    Mirrors transformers' `ROPE_INIT_FUNCTIONS`; "dynamic" returns the unscaled base here and
    is rescaled per call in `rope_tables` from the longest position it sees.
    """
    rs = config.rope_scaling
    dim = config.rotary_dim
    base = config.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    inv_freq = (1.0 / (base ** exponents)).astype(np.float32)
    if rs.kind in ("default", "dynamic"):
        return inv_freq, 1.0
    if rs.kind == "linear":
        return (inv_freq / rs.factor).astype(np.float32), 1.0
    if rs.kind == "llama3":
        old_ctx = rs.original_max_position_embeddings
        low_wavelen = old_ctx / rs.low_freq_factor
        high_wavelen = old_ctx / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rs.kind == "yarn":
        return _yarn_frequencies(config)
    raise ValueError(f"unsupported rope scaling {rs.kind!r}")


def _yarn_frequencies(config: Config) -> tuple[np.ndarray, float]:
    rs = config.rope_scaling
    dim, base, factor = config.rotary_dim, config.rope_theta, rs.factor
    orig = rs.original_max_position_embeddings or config.max_position_embeddings

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rs.attention_factor
    if attention_factor is None:
        if rs.mscale and rs.mscale_all_dim:
            attention_factor = get_mscale(factor, rs.mscale) / get_mscale(factor, rs.mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(config: Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim] (float32) for integer positions [B, T]."""
    inv_freq, attention_factor = rope_frequencies(config)
    inv_freq = jnp.asarray(inv_freq)
    rs = config.rope_scaling
    if rs.kind == "dynamic":
        # NTK-aware: once the sequence outgrows the original context, raise the base.
        dim = config.rotary_dim
        orig = config.max_position_embeddings  # HF's dynamic NTK measures against this, not original_*
        seq_len = (jnp.max(positions) + 1).astype(jnp.float32)
        new_base = config.rope_theta * ((rs.factor * seq_len / orig) - (rs.factor - 1)) ** (dim / (dim - 2))
        exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        inv_freq = jnp.where(seq_len > orig, 1.0 / (new_base ** exponents), inv_freq)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rotary_dim/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, T, rotary_dim]
    return jnp.cos(emb) * attention_factor, jnp.sin(emb) * attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, D]; cos/sin [B, T, R] with R <= D (partial rotary leaves the tail as is)."""
    rot = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    xr, tail = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = xr * cos + rotated * sin
    return jnp.concatenate([out, tail], axis=-1) if tail.shape[-1] else out


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------


def attention_reference(q, k, v, q_pos, kv_pos, *, window=None, sm_scale=None):
    """Masked GQA attention in plain jnp.

    q [B, T, Hq, D]; k, v [B, S, Hkv, D]; q_pos [B, T], kv_pos [B, S] int32 positions.
    A key is visible when kv_pos <= q_pos (and q_pos - kv_pos < window). Scores and softmax in
    float32; probabilities are cast to v's dtype before the second matmul, as HF's eager path does.
    Returns [B, T, Hq, D] in q's dtype.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qg = q.reshape(b, t, hkv, hq // hkv, d)  # [B, T, Hkv, G, D]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = kv_pos[:, None, :] <= q_pos[:, :, None]  # [B, T, S]
    if window is not None:
        visible &= (q_pos[:, :, None] - kv_pos[:, None, :]) < window
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    # Rows with no visible key (padding queries) would be NaN; give them zeros instead.
    s_max = jnp.max(s, axis=-1, keepdims=True)
    s_max = jnp.where(jnp.isfinite(s_max), s_max, 0.0)
    p = jnp.exp(s - s_max)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, hq, d).astype(q.dtype)


def _kernel_head_dim(d: int) -> bool:
    return 16 <= d <= 256 and d & (d - 1) == 0  # the Triton attention kernels' tiles


def causal_self_attention(q, k, v, positions, *, window=None):
    """Causal attention among T new tokens at positions 0..T-1 (full forward, fresh prefill).

    q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]. On GPU our flash-attention kernel
    (never materializes the [T, T] scores; assumes positions 0..T-1); elsewhere the masked
    reference, exact for any `positions`.
    """
    if use_kernels(q.dtype) and _kernel_head_dim(q.shape[-1]):
        from pallas_kernels import flash_attention

        return flash_attention(q, k, v, causal=True, sliding_window=window)
    return attention_reference(q, k, v, positions, positions, window=window)


def cached_attention(q, k_cache, v_cache, q_pos, *, window=None):
    """New tokens q [B, T, Hq, D] at positions q_pos [B, T] against a cache [B, S, Hkv, D] whose
    slot i holds position i (slots past a row's length are hidden by causality). One token per
    row on GPU: the split-K decode kernel, reading only the valid slots."""
    if use_kernels(q.dtype) and q.shape[1] == 1 and _kernel_head_dim(q.shape[-1]):
        from pallas_kernels import decode_attention

        out = decode_attention(q[:, 0], k_cache, v_cache, q_pos[:, 0] + 1, sliding_window=window)
        return out[:, None]  # [B, 1, Hq, D]
    kv_pos = jnp.broadcast_to(jnp.arange(k_cache.shape[1], dtype=jnp.int32), k_cache.shape[:2])
    return attention_reference(q, k_cache, v_cache, q_pos, kv_pos, window=window)


def fused_decode_attention_ok(h: jax.Array, head_dim: int, rotary_dim: int) -> bool:
    """Whether `decode_attention_qkv` runs as one kernel for the attention input h [B, T, D]:
    GPU, 16-bit, one new token per row, a kernel head dim with RoPE over all of it."""
    return (use_kernels(h.dtype) and h.shape[1] == 1 and _kernel_head_dim(head_dim)
            and _kernel_head_dim(head_dim // 2) and rotary_dim == head_dim)


def decode_attention_qkv(qkv, k_cache, v_cache, positions, cos, sin, *, window=None,
                         norm=None):
    """One new token per row, straight from the fused projection qkv [B, 1, Hkv, G + 2, D] (or
    its split-K chunks, Partials [S, B, 1, Hkv, G + 2, D], summed by the kernel): RoPE on its
    q and k (cos/sin [B, 1, D]), k and v written to slot positions [B, 1] of one layer's cache
    [B, S, Hkv, D], q attending to slots <= its position. norm: the deferred RMSNorm of
    `norm_qkv` (the chunks' sum is scaled by it) or None. One kernel
    (pallas_kernels/decode_attention_append.py), updating the donated cache in place; only
    where `fused_decode_attention_ok`. Returns (out [B, 1, Hq, D], k_cache, v_cache)."""
    from pallas_kernels import decode_attention_append

    qkv = qkv.parts[:, :, 0] if isinstance(qkv, Partials) else qkv[:, 0]  # drop T = 1
    out, k_cache, v_cache = decode_attention_append(
        qkv, k_cache, v_cache, positions[:, 0], rope=(cos[:, 0], sin[:, 0]),
        sliding_window=window, norm=norm)
    return out[:, None], k_cache, v_cache
