"""`moe_mlp`: the Mixture-of-Experts MLP sublayer, with `route` and `expert_counts` beside it.

    route(router_logits [N, E] f32, moe, bias=None) -> (weights [N, k] f32, experts [N, k] i32)
    expert_counts(experts [N, k], E) -> [E] int32     tokens routed to each expert
    moe_mlp(stream, norm_weight, layer_params, plan)  the sublayer, on the residual stream

A MoE layer's params: "router" [D, E] (a float32 Dense), "router_bias" [E] float32 (with
moe.score_bias), "experts_gate" / "experts_up" [E, D, F] and "experts_down" [E, F, D]
(stacked: plain arrays, or QuantizedWeights whose every array has the expert axis first,
pallas_kernels.quantized.stack_experts), and with shared experts "shared_gate" / "shared_up"
[D, Fs] and "shared_down" [Fs, D] (Dense, a gated MLP every token runs).

The routed experts go through EXPERTS, picked by the plan (KernelPolicy.moe and
moe_decode_rows): "pallas_decode" and "pallas_grouped" are pallas_kernels/moe.py's kernels,
which index the stacked weights by expert inside the kernel (at most moe_decode_rows token
rows: one program row per token-expert assignment; above: a grouped GEMM over the rows sorted
by expert); "ragged_dot" sorts the assignments by expert and runs each projection as one
jax.lax.ragged_dot (no token dropping, no capacity); "gather" takes each token's k chosen
experts' weights, so a decode step reads only those; "dense" runs every expert on every token
with the unchosen weights zero (the reference, E / k times the work); "cpu_kernel" takes a CPU
decode step's quantized experts (pallas_kernels/cpu_quantized.cc: an assignment a row, through
its expert's codes). Quantized experts: the kernels dequantize the chosen experts' tiles in
registers; gather dequantizes the chosen experts' slices, ragged_dot and dense the whole
stacked weights (references, fallbacks).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxinfer.configs import MoEConfig
from jaxinfer.ops.dispatch import KERNEL_DTYPES, Registry, always, kernels_on, rows
from jaxinfer.ops.blocked import int8_rows
from jaxinfer.ops.linear import boundary, matmul
from jaxinfer.ops.mlp import SWIGLU
from jaxinfer.ops.sharded import experts_layout
from jaxinfer.ops.stream import ANY_SUM, Deferred, Form, Partials, Residual
from jaxinfer.plan import Boundary, Kernels, MoEImpl, Plan
from jaxinfer.weights import Kind, ParamSpec, QuantizedWeight
from pallas_kernels import cpu_quantized
from pallas_kernels._common import next_pow2
from pallas_kernels.moe import take_dequantized
from pallas_kernels.quantized import dequantize, num_experts

# ---------------------------------------------------------------------------------------------
# The parameters of a MoE layer's MLP (every family with experts declares these)
# ---------------------------------------------------------------------------------------------


def moe_param_specs(config) -> dict:
    """The MoE MLP's params of one layer (beside the layer's "mlp_norm"), by the names
    moe_mlp reads; the expert axis first, as the logical axis "experts"."""
    moe, d = config.moe, config.hidden_size
    e, f = moe.num_experts, moe.expert_intermediate_size
    specs = {
        "router": ParamSpec((d, e), ("embed", None), kind=Kind.DENSE, dtype="float32"),
        "experts_gate": ParamSpec((e, d, f), ("experts", "embed", "mlp"), kind=Kind.EXPERTS),
        "experts_up": ParamSpec((e, d, f), ("experts", "embed", "mlp"), kind=Kind.EXPERTS),
        "experts_down": ParamSpec((e, f, d), ("experts", "mlp", "embed"), kind=Kind.EXPERTS),
    }
    if moe.score_bias:
        specs["router_bias"] = ParamSpec((e,), (None,), "zeros", dtype="float32")
    if moe.num_shared_experts:
        fs = moe.shared_size
        specs["shared_gate"] = ParamSpec((d, fs), ("embed", "mlp"), kind=Kind.DENSE)
        specs["shared_up"] = ParamSpec((d, fs), ("embed", "mlp"), kind=Kind.DENSE)
        specs["shared_down"] = ParamSpec((fs, d), ("mlp", "embed"), kind=Kind.DENSE)
    return specs


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def route(router_logits: jax.Array, moe: MoEConfig, bias: jax.Array | None = None):
    """Each token's k experts and their weights, as transformers' routers choose them.

    softmax (Mixtral, Qwen3-MoE, DeepSeek-V2) or sigmoid (DeepSeek-V3) scores; `bias` [E]
    (DeepSeek-V3's e_score_correction_bias) shifts the scores for the choice only; with
    n_group > 1 only the topk_group best groups compete (a group's score: its best expert,
    or the sum of its best two). The weights are the chosen unbiased scores, renormalised to
    sum to 1 with norm_topk_prob, times routed_scaling_factor. Experts come best first.
    router_logits [N, E] float32 -> (weights [N, k] float32, experts [N, k] int32).
    """
    e, k = moe.num_experts, moe.experts_per_token
    if router_logits.ndim != 2 or router_logits.shape[-1] != e:
        raise ValueError(f"route: router_logits {tuple(router_logits.shape)} must be "
                         f"[tokens, num_experts={e}]")
    if bias is not None and tuple(bias.shape) != (e,):
        raise ValueError(f"route: bias {tuple(bias.shape)} must be [num_experts={e}]")
    logits = router_logits.astype(jnp.float32)
    if moe.router == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)  # [N, E]
    if moe.n_group > 1 and moe.topk_group < moe.n_group:
        n, g = choice.shape[0], moe.n_group
        grouped = choice.reshape(n, g, e // g)
        if moe.group_scoring == "max":
            group_scores = grouped.max(axis=-1)  # [N, G]
        else:
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        kept = jax.lax.top_k(group_scores, moe.topk_group)[1]  # [N, topk_group]
        keep = jnp.zeros((n, g), bool).at[jnp.arange(n)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, e // g, axis=-1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, k)[1].astype(jnp.int32)  # [N, k]
    weights = jnp.take_along_axis(scores, experts, axis=-1)  # [N, k]
    if moe.norm_topk_prob:
        # DeepSeek-V3's sigmoid weights may all be tiny; transformers guards that sum alone.
        total = weights.sum(axis=-1, keepdims=True)
        weights = weights / (total + 1e-20 if moe.router == "sigmoid" else total)
    return weights * moe.routed_scaling_factor, experts


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """How many token-expert assignments each expert got: experts [N, k] -> [E] int32."""
    return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The routed experts: (x [B, T, D], weights [N, k], experts [N, k], w_gate, w_up, w_down, plan)
#   -> sum_j weights[:, j] * expert_{experts[:, j]}(x) [B, T, D] float32, N = B * T
# ---------------------------------------------------------------------------------------------

EXPERTS = Registry("experts", layout=experts_layout, every=True)


def experts_shape(w) -> tuple[int, ...]:
    """[E, K, N] of a stacked experts' weight: an array, or a stacked QuantizedWeight."""
    if isinstance(w, QuantizedWeight):
        return (num_experts(w), w.k, w.n)
    return tuple(w.shape)


def _whole(w, dtype, x):
    """A stacked weight as an array [E, K, N] in dtype (a QuantizedWeight dequantized whole:
    the XLA paths that run every expert), made after x is: tied to the layer's input, a
    layer's float experts are a temporary of that layer, never every layer's at once (XLA
    would otherwise dequantize them up front or hoist them out of a decode loop)."""
    if not isinstance(w, QuantizedWeight):
        return w.astype(dtype)
    w, _ = jax.lax.optimization_barrier((w, x))
    return dequantize(w, dtype)


def _swiglu_act(g, u, dtype):
    """silu(g) * u from float32 projections, in the activations' dtype (as HF rounds it)."""
    return (jax.nn.silu(g.astype(dtype)) * u.astype(dtype)).astype(dtype)


def _decode_rows_reason(x, w_gate, plan) -> str | None:
    """Why x [B, T, D] does not take the decode path (one row per assignment), or None. With
    batch_invariant the choice follows the query length: one token per row takes it up to
    fused_rows rows, whatever moe_decode_rows says."""
    policy = plan.policy
    limit = policy.decode_rows(plan.config.moe.num_experts, plan.config.moe.experts_per_token)
    if policy.batch_invariant:
        if x.shape[1] != 1:
            return "batch-invariant plans take the decode path at one token per row only"
        limit = max(limit, policy.fused_rows)
    if rows(x) > limit:
        return f"{rows(x)} token rows > moe_decode_rows={limit}"
    return None


def _pallas_reason(x, w_gate, plan) -> str | None:
    """Why the Pallas experts kernels do not take these inputs, or None."""
    policy = plan.policy
    if policy.moe not in (MoEImpl.AUTO, MoEImpl.PALLAS):
        return f"the plan asks for {policy.moe.value}"
    if policy.kernels is Kernels.REFERENCE:
        return "the plan asks for the references"
    if not (policy.interpret or policy.kernels is Kernels.PALLAS
            or jax.default_backend() == "gpu"):
        return "no GPU (KernelPolicy(interpret=True) runs the kernels on a CPU)"
    dtype = jnp.dtype(x.dtype)
    if dtype not in (*KERNEL_DTYPES, jnp.dtype(jnp.float32)):
        return f"activations in {dtype}"
    if dtype == jnp.float32 and policy.moe is MoEImpl.AUTO and not policy.interpret:
        return "float32 activations take XLA's paths under AUTO (IEEE float32 dots)"
    return None


def _weights_reason(dtype, w_gate, w_up, w_down) -> str | None:
    """Why the Triton kernels do not take these stacked weights, or None: plain ones must be
    in the activations' dtype; a quantized gate and up share one K loop, so one K tile."""
    for w in (w_gate, w_up, w_down):
        if not isinstance(w, QuantizedWeight) and getattr(w, "dtype", None) != dtype:
            return (f"expert weights {getattr(w, 'dtype', type(w).__name__)} differ "
                    f"from the activations' {dtype}")
        if isinstance(w, QuantizedWeight) and w.layout == "nk":
            return "experts laid out for the Mosaic GPU kernel (nk)"
    tiles = {w.tile for w in (w_gate, w_up) if isinstance(w, QuantizedWeight)}
    if len(tiles) > 1:
        return f"quantized gate and up weights with different K tiles {sorted(tiles)}"
    return None


def _pallas_decode_supports(x, weights, experts, w_gate, w_up, w_down, plan) -> str | None:
    return (_pallas_reason(x, w_gate, plan) or _weights_reason(x.dtype, w_gate, w_up, w_down)
            or _decode_rows_reason(x, w_gate, plan))


def _pallas_experts(kernel, x, weights, experts, w_gate, w_up, w_down, plan):
    """x [B, T, D] through pk.moe_decode or pk.moe_grouped (the plan's tiles for it)."""
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = (plan.policy.moe_decode_blocks if kernel is pk.moe_decode
              else plan.policy.moe_grouped_blocks)
    out = kernel(x.reshape(-1, d), weights, experts, w_gate, w_up, w_down,
                 interpret=plan.policy.interpret, block_sizes=blocks)  # [N, D] float32
    return out.reshape(*lead, d)


def _mosaic_decode_supports(x, weights, experts, w_gate, w_up, w_down, plan) -> str | None:
    if not all(isinstance(w, QuantizedWeight) and w.layout == "nk"
               for w in (w_gate, w_up, w_down)):
        return "experts not all laid out for the Mosaic GPU kernel (nk)"
    if plan.sharded or jnp.dtype(x.dtype) != jnp.bfloat16:
        return "a sharded plan or activations not bfloat16"
    assignments = rows(x) * plan.config.moe.experts_per_token  # the down projection's rows
    if assignments > plan.policy.mosaic_int_rows:
        return (f"{assignments} token-expert assignments (more than KernelPolicy."
                f"mosaic_int_rows = {plan.policy.mosaic_int_rows})")
    return _pallas_reason(x, w_gate, plan) or _decode_rows_reason(x, w_gate, plan)


@EXPERTS.register("mosaic_decode", _mosaic_decode_supports)
def _mosaic_decode(x, weights, experts, w_gate, w_up, w_down, plan, partials: bool = False):
    """pallas_kernels.quantized_mgpu's kernel with stacked experts: gate and up of every
    token-expert assignment in one launch (each reads only its expert's codes), the SwiGLU,
    the down projection in a second launch, the k experts weighted. partials: the [S, B, T, D]
    float32 chunks a consumer kernel adds (the next boundary: no add or norm launch). Where
    down's K ranges S are at least 2 k (Mixtral: 4 for k = 2), the assignments go slot by
    slot, each one's routing weight in its SwiGLU (down is linear) and down in S / k ranges,
    so its [S / k, k N, D] sums are the S chunks as they are (-2% a Mixtral int4 step on an
    H100; fewer than 2 ranges an expert slow down more than that saves); else each K range's
    k experts weighted and added (one small fusion)."""
    lead, d = x.shape[:-1], x.shape[-1]
    n, k = experts.shape
    interpret, f32 = plan.policy.interpret, jnp.float32
    cfg = pk.weight_config(w_down, n * k) if partials else None
    if partials and cfg.splits >= 2 * k:
        ids = experts.T.reshape(-1)  # [A = k N]: assignment j N + r is row r's j-th expert
        g, u = pk.quantized_matmul_mgpu(x.reshape(n, d), (w_gate, w_up), experts=(
            ids, jnp.arange(n * k) % n), interpret=interpret, out_dtype=f32)  # [A, F] each
        act = (_swiglu_act(g, u, x.dtype).astype(f32)
               * weights.T.reshape(-1, 1)).astype(x.dtype)  # [A, F], weighted
        y = pk.quantized_matmul_mgpu(act, w_down, experts=(ids, jnp.arange(n * k)),
                                     cfg=dataclasses.replace(cfg, splits=cfg.splits // k),
                                     interpret=interpret, out_dtype=f32,
                                     partials=True)  # [S / k, k N, D]
        return y.reshape(-1, *lead, d)
    ids = experts.reshape(-1)  # [A = N k]
    g, u = pk.quantized_matmul_mgpu(x.reshape(n, d), (w_gate, w_up), experts=(
        ids, jnp.arange(n * k) // k), interpret=interpret, out_dtype=f32)  # [A, F] each
    y = pk.quantized_matmul_mgpu(_swiglu_act(g, u, x.dtype), w_down, experts=(
        ids, jnp.arange(n * k)), interpret=interpret, out_dtype=f32,
        partials=partials)  # [A, D]; partials: [S, A, D]
    if partials:  # [S, N, k, D] -> [S, B, T, D]: as many chunks as down's K ranges
        y = jnp.sum(y.reshape(-1, n, k, d) * weights[None, :, :, None], axis=2)  # a fusion
        return y.reshape(-1, *lead, d)
    return jnp.einsum("nkd,nk->nd", y.reshape(n, k, d), weights).reshape(*lead, d)


@EXPERTS.register("pallas_decode", _pallas_decode_supports)
def _pallas_decode(x, weights, experts, w_gate, w_up, w_down, plan):
    """pallas_kernels.moe_decode: each assignment's expert streamed by its own programs."""
    return _pallas_experts(pk.moe_decode, x, weights, experts, w_gate, w_up, w_down, plan)


def _pallas_grouped_supports(x, weights, experts, w_gate, w_up, w_down, plan) -> str | None:
    return _pallas_reason(x, w_gate, plan) or _weights_reason(x.dtype, w_gate, w_up, w_down)


@EXPERTS.register("pallas_grouped", _pallas_grouped_supports)
def _pallas_grouped(x, weights, experts, w_gate, w_up, w_down, plan):
    """pallas_kernels.moe_grouped: the grouped GEMM over the rows sorted by expert."""
    return _pallas_experts(pk.moe_grouped, x, weights, experts, w_gate, w_up, w_down, plan)


def _gather_supports(x, weights, experts, w_gate, w_up, w_down, plan) -> str | None:
    policy = plan.policy
    if policy.moe is MoEImpl.GATHER:
        return None
    if policy.moe not in (MoEImpl.AUTO, MoEImpl.PALLAS):
        return f"the plan asks for {policy.moe.value}"
    return _decode_rows_reason(x, w_gate, plan)


def _cpu_supports(x, weights, experts, w_gate, w_up, w_down, plan) -> str | None:
    if plan.sharded:
        return "a sharded plan"
    if plan.policy.moe is not MoEImpl.AUTO:
        return f"the plan asks for {plan.policy.moe.value}"
    for w in (w_gate, w_up, w_down):
        why = cpu_quantized.unfit(w) if isinstance(w, QuantizedWeight) else "not quantized"
        if why:
            return f"experts the CPU kernel does not take ({why})"
    assignments = rows(x) * plan.config.moe.experts_per_token
    if assignments > plan.policy.cpu_quantized_rows:
        return (f"{assignments} token-expert rows > KernelPolicy.cpu_quantized_rows="
                f"{plan.policy.cpu_quantized_rows}")
    return None


@EXPERTS.register("cpu_kernel", _cpu_supports)
def _cpu_kernel(x, weights, experts, w_gate, w_up, w_down, plan):
    """Quantized experts on the CPU (pallas_kernels/cpu_quantized.cc): each token-expert
    assignment one row through its expert's codes, read once with no float copy (a decode
    step's few rows; more take ragged_dot)."""
    lead, d = x.shape[:-1], x.shape[-1]
    n, k = experts.shape
    ids = experts.reshape(-1)  # [N * k] assignments, token by token
    h = jnp.repeat(x.reshape(n, d).astype(jnp.float32), k, axis=0)  # [N * k, D]
    int8_x = plan.policy.cpu_int8_activations
    g = cpu_quantized.quantized_matmul_cpu(h, w_gate, ids, int8_x=int8_x)  # [N * k, F] float32
    u = cpu_quantized.quantized_matmul_cpu(h, w_up, ids, int8_x=int8_x)
    act = _swiglu_act(g, u, x.dtype).astype(jnp.float32)
    y = cpu_quantized.quantized_matmul_cpu(act, w_down, ids, int8_x=int8_x)  # [N * k, D]
    return jnp.einsum("nkd,nk->nd", y.reshape(n, k, d), weights).reshape(*lead, d)


@EXPERTS.register("gather", _gather_supports)
def _gather(x, weights, experts, w_gate, w_up, w_down, plan):
    """Each token's k experts' weights taken [N, k, D, F] and applied: only the chosen
    experts are read (the decode path, where N * k is below E or near it); quantized ones
    are dequantized from the chosen experts' codes and scales only."""
    lead, d = x.shape[:-1], x.shape[-1]
    h = int8_rows(x.reshape(-1, d), w_gate, plan)  # [N, D]
    g = jnp.einsum("nd,nkdf->nkf", h, take_dequantized(w_gate, experts, x.dtype),
                   preferred_element_type=jnp.float32)
    u = jnp.einsum("nd,nkdf->nkf", h, take_dequantized(w_up, experts, x.dtype),
                   preferred_element_type=jnp.float32)
    y = jnp.einsum("nkf,nkfd->nkd", int8_rows(_swiglu_act(g, u, x.dtype), w_down, plan),
                   take_dequantized(w_down, experts, x.dtype),
                   preferred_element_type=jnp.float32)
    return jnp.einsum("nkd,nk->nd", y, weights).reshape(*lead, d)


def _ragged_supports(x, weights, experts, w_gate, w_up, w_down, plan) -> str | None:
    if plan.policy.moe in (MoEImpl.AUTO, MoEImpl.PALLAS, MoEImpl.RAGGED_DOT):
        return None
    return f"the plan asks for {plan.policy.moe.value}"


@EXPERTS.register("ragged_dot", _ragged_supports)
def _ragged(x, weights, experts, w_gate, w_up, w_down, plan):
    """Token-expert assignments sorted by expert, each projection one grouped matmul over
    the groups (jax.lax.ragged_dot), the outputs weighted and scatter-added back (quantized
    experts dequantized whole to the activations' dtype first)."""
    lead, d = x.shape[:-1], x.shape[-1]
    n, k = experts.shape
    xs = int8_rows(x.reshape(n, d), w_gate, plan)  # [N, D]
    act_rows = functools.partial(int8_rows, w=w_down, plan=plan)
    w_gate, w_up, w_down = (_whole(w, x.dtype, x) for w in (w_gate, w_up, w_down))
    order = jnp.argsort(experts.reshape(-1), stable=True)  # [N * k] assignments by expert
    token = order // k  # each sorted assignment's token
    sizes = expert_counts(experts, w_gate.shape[0])  # [E] group sizes
    xs = xs[token]  # [N * k, D]
    g = jax.lax.ragged_dot(xs, w_gate, sizes, preferred_element_type=jnp.float32)  # [N*k, F]
    u = jax.lax.ragged_dot(xs, w_up, sizes, preferred_element_type=jnp.float32)
    y = jax.lax.ragged_dot(act_rows(_swiglu_act(g, u, x.dtype)), w_down, sizes,
                           preferred_element_type=jnp.float32)  # [N * k, D]
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n, d), jnp.float32).at[token].add(y).reshape(*lead, d)


@EXPERTS.register("dense", always)
def _dense(x, weights, experts, w_gate, w_up, w_down, plan):
    """The reference: every expert on every token, combined by an [N, E] matrix holding the
    routing weights of the chosen experts and zeros elsewhere."""
    lead, d = x.shape[:-1], x.shape[-1]
    n, e = experts.shape[0], experts_shape(w_gate)[0]
    f32 = jnp.float32  # operands upcast: exact for 16-bit ones, and XLA:CPU has no bf16 x
    # bf16 -> f32 batched dot
    h = int8_rows(x.reshape(n, d).astype(f32), w_gate, plan)
    combine = jnp.zeros((n, e), f32).at[jnp.arange(n)[:, None], experts].add(weights)
    g = jnp.einsum("nd,edf->nef", h, _whole(w_gate, f32, h))
    u = jnp.einsum("nd,edf->nef", h, _whole(w_up, f32, h))
    act = int8_rows(_swiglu_act(g, u, x.dtype).astype(f32), w_down, plan)
    y = jnp.einsum("nef,efd->ned", act, _whole(w_down, f32, act))
    return jnp.einsum("ned,ne->nd", y, combine).reshape(*lead, d)


# ---------------------------------------------------------------------------------------------
# The sublayer
# ---------------------------------------------------------------------------------------------


def _check_layer(lp: dict, moe: MoEConfig, d: int) -> None:
    e = moe.num_experts
    want = {"router": (d, e), "experts_gate": (e, d, moe.expert_intermediate_size),
            "experts_up": (e, d, moe.expert_intermediate_size),
            "experts_down": (e, moe.expert_intermediate_size, d)}
    for name, shape in want.items():
        w = lp.get(name)
        if isinstance(w, QuantizedWeight) and name.startswith("experts_"):
            got = experts_shape(w)
        else:
            got = None if w is None else tuple(getattr(w, "w", w).shape)
        if got != shape:
            raise ValueError(f"moe_mlp: {name} has shape {got}, expected {shape} (hidden {d}, "
                             f"{e} experts of {moe.expert_intermediate_size})")


ROUTE_BLOCK_ROWS = 8  # the fewest D rows a router block takes


def _route_blocks(h, lp: dict, plan: Plan) -> int | str:
    """How many D blocks the router at h [B, T, D] runs in as pallas_kernels.moe_route (1: one
    program a row), or why it takes XLA's ops."""
    moe, policy = plan.config.moe, plan.policy
    if not kernels_on(plan, h.dtype) or plan.sharded:
        return "kernels off, or a sharded plan"
    limit = policy.moe_route_rows
    # batch_invariant: one path for every row count (the kernel's rows are independent), so a
    # row's experts do not depend on the batch or on T (a verification's K + 1 tokens)
    if limit == 0 or (rows(h) > limit and not policy.batch_invariant):
        return f"{rows(h)} token rows > KernelPolicy.moe_route_rows={limit}"
    if lp.get("router_bias") is not None or (moe.n_group > 1 and moe.topk_group < moe.n_group):
        return "a score bias or group-limited routing (XLA's route)"
    d = h.shape[-1]
    size = 4 * d * moe.num_experts  # float32 [D, E]
    blocks = max(next_pow2(policy.moe_route_blocks),
                 next_pow2(-(-size // policy.moe_route_block_bytes)))
    while blocks > 1 and (d % blocks or d // blocks < ROUTE_BLOCK_ROWS):
        blocks //= 2
    return blocks


def _boundary_and_route(x, delta, norm_weight, lp: dict, plan: Plan):
    """The sublayer's boundary and router: (x + delta, h = its RMSNorm [B, T, D], weights,
    experts [B * T, k]). Where the boundary would be add_rms_norm's and the router a kernel,
    one kernel does both (gated_mlp_boundary CONSUMER: the router is h's first reader)."""
    config, policy, moe = plan.config, plan.policy, plan.config.moe
    b, t, d = x.shape
    pick = dict(k=moe.experts_per_token, scoring=moe.router, norm_topk_prob=moe.norm_topk_prob,
                scaling=moe.routed_scaling_factor, interpret=policy.interpret)
    if isinstance(delta, Partials) and delta.norm is None and not config.norm_offset \
            and policy.gated_mlp_boundary is Boundary.CONSUMER \
            and isinstance(blocks := _route_blocks(x, lp, plan), int):
        with jax.named_scope("router"):
            s = delta.parts.shape[0]
            x, h, weights, experts = pk.add_rms_norm_route(
                x.reshape(b * t, d), delta.parts.reshape(s, b * t, d), norm_weight,
                _router_weight(lp["router"]), eps=config.rms_norm_eps, blocks=blocks, **pick)
        return x.reshape(b, t, d), h.reshape(b, t, d), weights, experts
    x, h = boundary(x, delta, norm_weight, config.rms_norm_eps, plan,
                    policy.gated_mlp_boundary)  # h [B, T, D]
    with jax.named_scope("router"):
        if isinstance(blocks := _route_blocks(h, lp, plan), int):
            weights, experts = pk.moe_route(h.reshape(b * t, d), _router_weight(lp["router"]),
                                            blocks=blocks, **pick)  # [N, k] each
        else:
            weights, experts = route(router_logits(h, lp["router"]).reshape(b * t, -1), moe,
                                     lp.get("router_bias"))  # [N, k] each
    return x, h, weights, experts


def _router_weight(router) -> jax.Array:
    """The router [D, E] (a Dense or an array) in float32."""
    return getattr(router, "w", router).astype(jnp.float32)


def router_logits(h: jax.Array, router) -> jax.Array:
    """h [..., D] @ router [D, E] in float32 at full precision (no TF32: a near tie between
    two experts must not flip with the matmul's precision) -> [..., E] float32."""
    w = _router_weight(router)
    return jnp.dot(h.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)


def moe_mlp(stream: Residual, norm_weight, layer_params: dict, plan: Plan,
            loads: list | None = None) -> Residual:
    """The MoE sublayer: x + pending -> that stream, with the experts' output (the routed
    experts weighted, plus the shared experts) pending. layer_params: the layer's MoE params
    (names in the module docstring). loads: a list (at trace time) that gets this layer's
    expert_counts [E] appended (Model.expert_load)."""
    config, policy = plan.config, plan.policy
    moe, lp = config.moe, layer_params
    aval = stream.aval
    b, t, d = aval.shape
    _check_layer(lp, moe, d)
    x, delta = stream.take(ANY_SUM)
    x, h, weights, experts = _boundary_and_route(x, delta, norm_weight, lp, plan)
    if loads is not None:
        loads.append(expert_counts(experts, moe.num_experts))  # [E]
    rest = Residual(x, aval, spare=stream.spare, dead=stream.dead)
    experts_args = (h, weights, experts, lp["experts_gate"], lp["experts_up"],
                    lp["experts_down"], plan)
    kernel = EXPERTS.pick(*experts_args).name
    if not moe.num_shared_experts and not plan.sharded and (
            kernel in ("pallas_decode", "mosaic_decode") or (
            kernel == "pallas_grouped" and b * t <= policy.fused_rows)):
        # The kernels' weighted chunks go to the consumer, which adds them to the stream in
        # its own kernel at decode (no combine, add or norm kernel in between). A sharded
        # plan keeps EXPERTS, whose dispatcher runs the kernels under shard_map.
        def emit(accept, prefetch):
            with jax.named_scope("experts"):
                if Form.PARTIALS in accept and kernel == "mosaic_decode":
                    return (Partials(_mosaic_decode(*experts_args, partials=True)),)
                if Form.PARTIALS in accept:
                    decode = kernel == "pallas_decode"
                    parts = (pk.moe_decode if decode else pk.moe_grouped)(
                        h.reshape(b * t, d), *experts_args[1:-1], partials=True,
                        interpret=policy.interpret,
                        block_sizes=policy.moe_decode_blocks if decode
                        else policy.moe_grouped_blocks)  # [S * k, N, D] float32
                    return (Partials(parts.reshape(-1, b, t, d)),)
                return (EXPERTS(*experts_args).astype(aval.dtype),)

        return rest.with_pending(Deferred(emit).part(0))
    with jax.named_scope("experts"):
        out = EXPERTS(*experts_args)  # [B, T, D] float32
    if moe.num_shared_experts:
        with jax.named_scope("shared_experts"):
            _, act = SWIGLU(h, lp["shared_gate"], lp["shared_up"], plan)  # [B, T, Fs]
            out = out + matmul(act, lp["shared_down"], plan, out_dtype=jnp.float32)[1]
    return rest.with_pending(out.astype(aval.dtype))
