"""The DeepSeek family: DeepSeek-V2 (and V2-Lite) and DeepSeek-V3, multi-head latent attention
with Mixture-of-Experts MLPs.

A layer: the pre-norm boundary and one matmul for the query input and the KV latent (q_proj /
q_a_proj fused with kv_a_proj_with_mqa: both read the same normed stream), q_a_layernorm and
q_b_proj when the config has q_lora_rank, then `ops.mla_attend` (c_kv's norm, the decoupled RoPE
key shared by all heads, the latent cache, absorbed or expanded attention), o_proj; the MLP is
dense in the first `moe.first_dense_layers` layers and `ops.moe_mlp` (routed + shared experts)
after them. The layer loop is unrolled, as llama.py's (benchmarks/DECISIONS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ops
from jaxinfer.cache import LatentCache
from jaxinfer.configs import Config
from jaxinfer.models.family import ExpertLayout, Family, TensorMap
from jaxinfer.plan import Plan
from jaxinfer.weights import Dense, Kind, ParamSpec, Parts, QuantizedWeight, weight_format


def _q_width(config: Config) -> int:
    """Columns of the fused projection that feed the query: q_a_proj's (q_lora_rank), or
    q_proj's (heads x qk_head_dim)."""
    mla = config.mla
    return mla.q_lora_rank or config.num_heads * mla.qk_head_dim


def param_specs(config: Config) -> dict:
    """Every weight declared once ([in, out] for matmuls)."""
    mla, d, h = config.mla, config.hidden_size, config.num_heads
    f, dense = config.intermediate_size, Kind.DENSE
    attn = {
        "attn_norm": ParamSpec((d,), ("embed",), "ones"),
        # [q_proj or q_a_proj | kv_a_proj_with_mqa]: one pass over the normed stream
        "wq_kv_a": ParamSpec((d, _q_width(config) + mla.latent_dim), ("embed", None), kind=dense),
        "kv_a_norm": ParamSpec((mla.kv_lora_rank,), (None,), "ones"),
        "wkv_b": ParamSpec((mla.kv_lora_rank, h, mla.qk_nope_head_dim + mla.v_head_dim),
                           (None, "q_heads", None), kind=dense),
        "wo": ParamSpec((h * mla.v_head_dim, d), ("q_heads", "embed"), kind=dense),
        "mlp_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if mla.q_lora_rank is not None:
        attn["q_a_norm"] = ParamSpec((mla.q_lora_rank,), (None,), "ones")
        attn["wq_b"] = ParamSpec((mla.q_lora_rank, h, mla.qk_head_dim), (None, "q_heads", None),
                                 kind=dense)
    mlp = {"w_gate": ParamSpec((d, f), ("embed", "mlp"), kind=dense),
           "w_up": ParamSpec((d, f), ("embed", "mlp"), kind=dense),
           "w_down": ParamSpec((f, d), ("mlp", "embed"), kind=dense)}
    moe = ops.moe_param_specs(config) if config.moe is not None else {}
    specs = {
        "embed": ParamSpec((config.vocab_size, d), ("vocab", "embed"), kind=Kind.DENSE_T),
        "layers": [{**attn, **(moe if config.is_moe_layer(i) else mlp)}
                   for i in range(config.num_layers)],
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if not config.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, config.vocab_size), ("embed", "vocab"), kind=dense)
    return specs


def forward(params: dict, tokens: jax.Array, positions: jax.Array, plan: Plan,
            cache: LatentCache | None = None, logits_at: jax.Array | None = None,
            fresh: bool = False, loads: list | None = None, embeds: jax.Array | None = None,
            hidden: bool = False) -> tuple:
    """Causal forward pass, as llama.forward (the same arguments and cache contract; the cache
    is a LatentCache). Returns (logits [B, T or 1, V] float32, cache)."""
    config = plan.config
    mla, h = config.mla, config.num_heads
    b, t = tokens.shape
    nq = _q_width(config)
    rope = ops.rope_tables(config, positions)  # cos, sin [B, T, Dr]
    x = ops.embed(params["embed"], tokens, plan) if embeds is None else embeds  # [B, T, D]
    stream = ops.Residual.start(x)
    new_cache = []
    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            stream, proj = ops.norm_linear(stream, lp["attn_norm"], lp["wq_kv_a"], plan)
            qkv_a = proj.array()  # [B, T, Nq + R + Dr]
            if mla.q_lora_rank is None:
                q = qkv_a[..., :nq].reshape(b, t, h, mla.qk_head_dim)
            else:
                q_a = ops.norm(qkv_a[..., :nq], lp["q_a_norm"], config.rms_norm_eps, plan)
                q = ops.linear(q_a, lp["wq_b"], plan)  # [B, T, H, Dn + Dr]
            o, layer_cache = ops.mla_attend(
                q, qkv_a[..., nq:], None if cache is None else cache.layer(i), plan,
                positions=positions, rope=rope, kv_norm=lp["kv_a_norm"], w_kv_b=lp["wkv_b"],
                fresh=fresh)  # o [B, T, H, Dv]
            stream = ops.linear(o.reshape(b, t, -1), lp["wo"], plan, into=stream)
            if config.is_moe_layer(i):
                stream = ops.moe_mlp(stream, lp["mlp_norm"], lp, plan, loads=loads)
            else:
                stream = ops.gated_mlp(stream, lp["mlp_norm"], lp["w_gate"], lp["w_up"],
                                       lp["w_down"], plan)
            new_cache.append(layer_cache)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    out = ops.lm_head(stream, params["final_norm"], head, plan, rows_at=logits_at,
                      hidden=hidden)
    logits, h = out if hidden else (out, None)
    cache = None if cache is None else cache.with_layers(new_cache)
    return (logits, cache, h) if hidden else (logits, cache)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

HF_TENSORS = TensorMap(
    layer={
        "attn_norm": ("input_layernorm.weight", False),
        "wq": ("self_attn.q_proj.weight", True),
        "wq_a": ("self_attn.q_a_proj.weight", True),
        "q_a_norm": ("self_attn.q_a_layernorm.weight", False),
        "wq_b": ("self_attn.q_b_proj.weight", True),
        "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
        "kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
        "wkv_b": ("self_attn.kv_b_proj.weight", True),
        "wo": ("self_attn.o_proj.weight", True),
        "mlp_norm": ("post_attention_layernorm.weight", False),
        "w_gate": ("mlp.gate_proj.weight", True),
        "w_up": ("mlp.up_proj.weight", True),
        "w_down": ("mlp.down_proj.weight", True),
        "shared_gate": ("mlp.shared_experts.gate_proj.weight", True),
        "shared_up": ("mlp.shared_experts.up_proj.weight", True),
        "shared_down": ("mlp.shared_experts.down_proj.weight", True),
    },
    top={
        "embed": ("model.embed_tokens.weight", False),
        "final_norm": ("model.norm.weight", False),
        "lm_head": ("lm_head.weight", True),
    },
    # The per-expert layout transformers 5 writes and the Hub checkpoints have, then the
    # fused one transformers holds in memory.
    experts=(
        ExpertLayout(router="mlp.gate.weight", router_bias="mlp.gate.e_score_correction_bias",
                     per_expert={"experts_gate": "mlp.experts.{j}.gate_proj.weight",
                                 "experts_up": "mlp.experts.{j}.up_proj.weight",
                                 "experts_down": "mlp.experts.{j}.down_proj.weight"}),
        ExpertLayout(router="mlp.gate.weight", router_bias="mlp.gate.e_score_correction_bias",
                     fused={"experts_gate_up": "mlp.experts.gate_up_proj",
                            "experts_down": "mlp.experts.down_proj"}),
    ))

# llama.cpp's "deepseek2" names. Its converter splits kv_b_proj into attn_k_b / attn_v_b (the
# GGUF loader joins them back into wkv_b); files from before that split have attn_kv_b.
GGUF_TENSORS = TensorMap(
    layer={
        "attn_norm": ("attn_norm.weight", False),
        "wq": ("attn_q.weight", True),
        "wq_a": ("attn_q_a.weight", True),
        "q_a_norm": ("attn_q_a_norm.weight", False),
        "wq_b": ("attn_q_b.weight", True),
        "wkv_a": ("attn_kv_a_mqa.weight", True),
        "kv_a_norm": ("attn_kv_a_norm.weight", False),
        "wkv_b": ("attn_kv_b.weight", True),
        "wo": ("attn_output.weight", True),
        "mlp_norm": ("ffn_norm.weight", False),
        "w_gate": ("ffn_gate.weight", True),
        "w_up": ("ffn_up.weight", True),
        "w_down": ("ffn_down.weight", True),
        "shared_gate": ("ffn_gate_shexp.weight", True),
        "shared_up": ("ffn_up_shexp.weight", True),
        "shared_down": ("ffn_down_shexp.weight", True),
    },
    top={
        "embed": ("token_embd.weight", False),
        "final_norm": ("output_norm.weight", False),
        "lm_head": ("output.weight", True),
    },
    experts=(
        ExpertLayout(router="ffn_gate_inp.weight", router_bias="exp_probs_b.bias", fused={
            "experts_gate": "ffn_gate_exps.weight", "experts_up": "ffn_up_exps.weight",
            "experts_down": "ffn_down_exps.weight"}),
    ))


def checkpoint_shapes(config: Config) -> dict:
    """The checkpoint tensors' shapes in our [in, out] layout, before assemble_layer, of the
    names any layer may have (dense MLP or shared experts; the routed experts, which the
    loader stacks itself, not included)."""
    mla, d, h = config.mla, config.hidden_size, config.num_heads
    f, v = config.intermediate_size, config.vocab_size
    layer = {"attn_norm": (d,), "mlp_norm": (d,), "wkv_a": (d, mla.latent_dim),
             "kv_a_norm": (mla.kv_lora_rank,),
             "wkv_b": (mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim)),
             "wo": (h * mla.v_head_dim, d)}
    if mla.q_lora_rank is None:
        layer["wq"] = (d, h * mla.qk_head_dim)
    else:
        layer.update(wq_a=(d, mla.q_lora_rank), q_a_norm=(mla.q_lora_rank,),
                     wq_b=(mla.q_lora_rank, h * mla.qk_head_dim))
    layer.update(w_gate=(d, f), w_up=(d, f), w_down=(f, d))  # the dense layers'
    if config.moe is not None and config.moe.num_shared_experts:  # the MoE layers'
        fs = config.moe.shared_size
        layer.update(shared_gate=(d, fs), shared_up=(d, fs), shared_down=(fs, d))
    top = {"embed": (v, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        top["lm_head"] = (d, v)
    return {"layer": layer, "top": top}


def _concat_columns(ws: list, where: str):
    """[K, N_i] matmul weights side by side -> [K, sum N_i]: arrays concatenated (numpy stays
    numpy), QuantizedWeights of one layout by their columns (codes and scales alike), a mix
    kept as Parts (one matmul per part)."""
    if all(isinstance(w, QuantizedWeight) for w in ws) and len({weight_format(w)
                                                                 for w in ws}) == 1:
        first = ws[0]

        def cat(*arrays):
            return None if arrays[0] is None else jnp.concatenate(arrays, axis=1)
        return first.replace(
            planes=tuple(cat(*planes) for planes in zip(*(w.planes for w in ws))),
            **{f: cat(*(getattr(w, f) for w in ws))
               for f in ("scale", "offset", "super_scale", "super_offset")},
            out_shape=(sum(w.n for w in ws),))
    if any(isinstance(w, QuantizedWeight) for w in ws):
        parts = tuple(w if isinstance(w, QuantizedWeight) else Dense(w) for w in ws)
        widths = tuple(p.n if isinstance(p, QuantizedWeight) else p.w.shape[1] for p in parts)
        return Parts(parts, groups=1, widths=widths, inner=1, out_shape=(sum(widths),))
    xp = np if all(isinstance(w, np.ndarray) for w in ws) else jnp
    return xp.concatenate(ws, axis=1)


def assemble_layer(layer: dict, config: Config, where: str) -> dict:
    """Checkpoint tensors of one layer (our names, [in, out]) -> the layer's params: the query
    input projection and kv_a fused into wq_kv_a, the per-head weights seen [R, H, ...]; raises
    ValueError naming `where` and the shapes when they do not fit the config."""
    mla = config.mla
    shapes = checkpoint_shapes(config)["layer"]
    q_name = "wq" if mla.q_lora_rank is None else "wq_a"
    missing = [n for n in (q_name, "wkv_a", "wkv_b", "wo") if n not in layer]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (the config "
                         f"{'has no' if mla.q_lora_rank is None else 'has a'} q_lora_rank)")
    for name, shape in shapes.items():
        if name in layer and tuple(layer[name].shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(layer[name].shape)}, expected "
                             f"{shape} from the config (hidden {config.hidden_size}, heads "
                             f"{config.num_heads}, kv_lora_rank {mla.kv_lora_rank}, q_lora_rank "
                             f"{mla.q_lora_rank}, head dims {mla.qk_nope_head_dim} / "
                             f"{mla.qk_rope_head_dim} / {mla.v_head_dim})")
    out = {k: v for k, v in layer.items() if k not in (q_name, "wkv_a")}
    out["wq_kv_a"] = _concat_columns([layer[q_name], layer["wkv_a"]], where)
    h = config.num_heads
    for name in ("wq_b", "wkv_b"):
        if name in out and not isinstance(out[name], QuantizedWeight):
            out[name] = out[name].reshape(out[name].shape[0], h, -1)  # [in, H, per head]
    return out


FAMILY = Family(
    name="deepseek", param_specs=param_specs, forward=forward,
    hf_architectures=("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
    hf_tensors=HF_TENSORS, gguf_architectures=("deepseek2",), gguf_tensors=GGUF_TENSORS,
    assemble_layer=assemble_layer, checkpoint_shapes=checkpoint_shapes)
