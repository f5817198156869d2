"""The model ops: one entry point per operation, each dispatching to a Pallas kernel or the
pure-jnp reference (see dispatch.py); families are wired from these and nothing else.

    embed(table, tokens, plan)                       [B, T] -> [B, T, D]
    norm_linear(stream, norm_w, w, plan, bias=)      the boundary + a projection (for attend)
    attend(qkv, cache, plan, positions=, rope=, ...) RoPE, the cache append, attention
    linear(x, w, plan, bias=, into=stream)           x @ w, or a sublayer output for the stream
    gated_mlp(stream, norm_w, w_gate, w_up, w_down, plan)
    moe_mlp(stream, norm_w, layer_params, plan)      the MoE MLP (params: moe_param_specs);
                                                     route(), expert_counts()
    mla_attend(q, kv_a, cache, plan, positions=, ...) multi-head latent attention (DeepSeek)
                                                     over the latent cache (ops/mla.py)
    lm_head(stream, norm_w, head, plan, rows_at=)    the final boundary and float32 logits
    norm(x, w, eps, plan); rope_tables(config, positions)
"""

from jaxinfer.ops.attention import ATTEND, ATTENTION_CORE, attend
from jaxinfer.ops.linear import EMBED, MATMUL, embed, linear, lm_head, norm, norm_linear
from jaxinfer.ops.mla import MLA_ATTEND, MLA_CORE, MLA_PREFILL, mla_attend
from jaxinfer.ops.mlp import SWIGLU, gated_mlp
from jaxinfer.ops.moe import EXPERTS, expert_counts, moe_mlp, moe_param_specs, route
from jaxinfer.ops.reference import rope_tables
from jaxinfer.ops.stream import Partials, Projection, Residual

__all__ = ["ATTEND", "ATTENTION_CORE", "EMBED", "EXPERTS", "MATMUL", "SWIGLU", "Partials",
           "Projection", "Residual", "attend", "embed", "expert_counts", "gated_mlp", "linear",
           "lm_head", "moe_mlp", "moe_param_specs", "norm", "norm_linear", "rope_tables", "route"]
__all__ += ["MLA_ATTEND", "MLA_CORE", "MLA_PREFILL", "mla_attend"]
