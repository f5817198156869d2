"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3, SmolLM; Mixtral, Qwen3-MoE.

The family differences are switches on `Config` (qkv bias, q/k norm, sliding windows, RoPE
scaling, tied embeddings, experts in the layers `config.is_moe_layer(i)` names), so one
forward covers them all. The forward is a wiring diagram of
ops (jaxinfer/ops): which kernels run, and how the residual stream's sublayer boundaries fuse
into them, is the ops' business and the plan's.

Layer loop: a Python loop over per-layer weights, unrolled at trace time: `lax.scan` over
stacked [L, ...] weights made XLA copy each layer's weights every decode step
(benchmarks/DECISIONS.md); the cost is compile time linear in the number of layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ops
from jaxinfer.cache import KVCache
from jaxinfer.configs import Config
from jaxinfer.models.family import ExpertLayout, Family, TensorMap
from jaxinfer.plan import Plan
from jaxinfer.weights import Dense, Kind, ParamSpec, Parts, QuantizedWeight, weight_format


def param_specs(config: Config) -> dict:
    """Every weight declared once: shape ([in, out] for matmuls), logical axes, initializer."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    hkv, g = config.num_kv_heads, config.num_heads // config.num_kv_heads
    dense = Kind.DENSE
    layer = {
        "attn_norm": ParamSpec((d,), ("embed",), "ones"),
        # q, k and v in one weight: per KV head its G query heads, its key, its value (one
        # matmul instead of three; sharding the Hkv axis keeps a head's q, k, v together).
        "wqkv": ParamSpec((d, hkv, g + 2, hd), ("embed", "kv_heads", None, None), kind=dense),
        "wo": ParamSpec((config.num_heads * hd, d), ("q_heads", "embed"), kind=dense),
        "mlp_norm": ParamSpec((d,), ("embed",), "ones"),
        "w_gate": ParamSpec((d, f), ("embed", "mlp"), kind=dense),
        "w_up": ParamSpec((d, f), ("embed", "mlp"), kind=dense),
        "w_down": ParamSpec((f, d), ("mlp", "embed"), kind=dense),
    }
    if config.qkv_bias:
        layer["bqkv"] = ParamSpec((hkv, g + 2, hd), ("kv_heads", None, None), "zeros")
    if config.o_bias:
        layer["bo"] = ParamSpec((d,), ("embed",), "zeros")
    if config.mlp_bias:
        layer["b_gate"] = ParamSpec((f,), ("mlp",), "zeros")
        layer["b_up"] = ParamSpec((f,), ("mlp",), "zeros")
        layer["b_down"] = ParamSpec((d,), ("embed",), "zeros")
    if config.qk_norm:
        layer["q_norm"] = ParamSpec((hd,), (None,), "ones")
        layer["k_norm"] = ParamSpec((hd,), (None,), "ones")
    mlp = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
    moe_layer = {**{k: v for k, v in layer.items() if k not in mlp},
                 **ops.moe_param_specs(config)} if config.moe is not None else None
    specs = {
        "embed": ParamSpec((config.vocab_size, d), ("vocab", "embed"), kind=Kind.DENSE_T),
        "layers": [dict(moe_layer if config.is_moe_layer(i) else layer)
                   for i in range(config.num_layers)],
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if not config.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, config.vocab_size), ("embed", "vocab"), kind=dense)
    return specs


def forward(params: dict, tokens: jax.Array, positions: jax.Array, plan: Plan,
            cache: KVCache | None = None, logits_at: jax.Array | None = None,
            fresh: bool = False, loads: list | None = None, embeds: jax.Array | None = None,
            hidden: bool = False) -> tuple:
    """Causal forward pass.

    tokens, positions: [B, T] int32. Without a cache, the T tokens attend among themselves
    (positions 0..T-1). With a cache, their K/V are written to slots `positions` and they
    attend to every cache slot at or before their position; `fresh=True` says the cache held
    nothing before them (a prefill from position 0). `cache.lengths` is left for the caller.
    logits_at: optional [B] index into T; then only those rows get logits ([B, 1, V]).
    loads: a list each MoE layer appends its expert_counts [E] to (Model.expert_load).
    embeds: [B, T, D] inputs instead of the tokens' embeddings (a speculative draft head runs
    one layer of the family on its own inputs, jaxinfer/draft_head.py).
    Returns (logits [B, T or 1, V] float32, cache); hidden=True (static): (logits, cache, h)
    with h [B, T, D] the final-normed stream, the LM head's input (ops.lm_head), at every
    position.
    """
    config = plan.config
    b, t = tokens.shape
    rope = ops.rope_tables(config, positions)  # cos, sin [B, T, R]
    x = ops.embed(params["embed"], tokens, plan) if embeds is None else embeds  # [B, T, D]
    stream = ops.Residual.start(x)
    new_cache = []
    for i, lp in enumerate(params["layers"]):
        with jax.named_scope(f"layer{i}"):
            stream, qkv = ops.norm_linear(stream, lp["attn_norm"], lp["wqkv"], plan,
                                          bias=lp.get("bqkv"))  # qkv [B, T, Hkv, G + 2, hd]
            o, layer_cache = ops.attend(
                qkv, None if cache is None else cache.layer(i), plan, positions=positions,
                rope=rope, window=config.window(i), q_norm=lp.get("q_norm"),
                k_norm=lp.get("k_norm"), fresh=fresh)  # o [B, T, Hq, hd]
            stream = ops.linear(o.reshape(b, t, -1), lp["wo"], plan, bias=lp.get("bo"),
                                into=stream)
            if config.is_moe_layer(i):
                stream = ops.moe_mlp(stream, lp["mlp_norm"], lp, plan, loads=loads)
            else:
                biases = (lp["b_gate"], lp["b_up"], lp["b_down"]) if config.mlp_bias else None
                stream = ops.gated_mlp(stream, lp["mlp_norm"], lp["w_gate"], lp["w_up"],
                                       lp["w_down"], plan, biases=biases)
            new_cache.append(layer_cache)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    out = ops.lm_head(stream, params["final_norm"], head, plan, rows_at=logits_at,
                      hidden=hidden)
    logits, h = out if hidden else (out, None)
    cache = None if cache is None else cache.with_layers(new_cache)
    return (logits, cache, h) if hidden else (logits, cache)


# ---------------------------------------------------------------------------------------------
# Checkpoints: tensor names, and the one place per-projection tensors become the fused layout
# ---------------------------------------------------------------------------------------------

HF_TENSORS = TensorMap(
    layer={
        "attn_norm": ("input_layernorm.weight", False),
        "wq": ("self_attn.q_proj.weight", True),
        "wk": ("self_attn.k_proj.weight", True),
        "wv": ("self_attn.v_proj.weight", True),
        "wo": ("self_attn.o_proj.weight", True),
        "bq": ("self_attn.q_proj.bias", False),
        "bk": ("self_attn.k_proj.bias", False),
        "bv": ("self_attn.v_proj.bias", False),
        "bo": ("self_attn.o_proj.bias", False),
        "q_norm": ("self_attn.q_norm.weight", False),
        "k_norm": ("self_attn.k_norm.weight", False),
        "mlp_norm": ("post_attention_layernorm.weight", False),
        "w_gate": ("mlp.gate_proj.weight", True),
        "w_up": ("mlp.up_proj.weight", True),
        "w_down": ("mlp.down_proj.weight", True),
        "b_gate": ("mlp.gate_proj.bias", False),
        "b_up": ("mlp.up_proj.bias", False),
        "b_down": ("mlp.down_proj.bias", False),
    },
    top={
        "embed": ("model.embed_tokens.weight", False),
        "final_norm": ("model.norm.weight", False),
        "lm_head": ("lm_head.weight", True),
    },
    # MoE layers: the per-expert layouts transformers 5 writes (and Hub checkpoints have),
    # then the fused one it holds in memory.
    experts=(
        ExpertLayout(router="block_sparse_moe.gate.weight", per_expert={  # Mixtral
            "experts_gate": "block_sparse_moe.experts.{j}.w1.weight",
            "experts_up": "block_sparse_moe.experts.{j}.w3.weight",
            "experts_down": "block_sparse_moe.experts.{j}.w2.weight"}),
        ExpertLayout(router="mlp.gate.weight", per_expert={  # Qwen3-MoE
            "experts_gate": "mlp.experts.{j}.gate_proj.weight",
            "experts_up": "mlp.experts.{j}.up_proj.weight",
            "experts_down": "mlp.experts.{j}.down_proj.weight"}),
        ExpertLayout(router="mlp.gate.weight", fused={
            "experts_gate_up": "mlp.experts.gate_up_proj",
            "experts_down": "mlp.experts.down_proj"}),
    ))

# gguf's TENSOR_NAMES (MODEL_ARCH.LLAMA / QWEN2 / QWEN3), ".weight" / ".bias" as the converter
# appends them.
GGUF_TENSORS = TensorMap(
    layer={
        "attn_norm": ("attn_norm.weight", False),
        "wq": ("attn_q.weight", True),
        "wk": ("attn_k.weight", True),
        "wv": ("attn_v.weight", True),
        "wo": ("attn_output.weight", True),
        "bq": ("attn_q.bias", False),
        "bk": ("attn_k.bias", False),
        "bv": ("attn_v.bias", False),
        "bo": ("attn_output.bias", False),
        "q_norm": ("attn_q_norm.weight", False),
        "k_norm": ("attn_k_norm.weight", False),
        "mlp_norm": ("ffn_norm.weight", False),
        "w_gate": ("ffn_gate.weight", True),
        "w_up": ("ffn_up.weight", True),
        "w_down": ("ffn_down.weight", True),
        "b_gate": ("ffn_gate.bias", False),
        "b_up": ("ffn_up.bias", False),
        "b_down": ("ffn_down.bias", False),
    },
    top={
        "embed": ("token_embd.weight", False),
        "final_norm": ("output_norm.weight", False),
        "lm_head": ("output.weight", True),
    },
    # MoE layers (Mixtral as "llama", "qwen3moe"): the experts stacked [E, out, in] as
    # llama.cpp's converter writes them, then the per-expert tensors of older Mixtral files.
    experts=(
        ExpertLayout(router="ffn_gate_inp.weight", fused={
            "experts_gate": "ffn_gate_exps.weight", "experts_up": "ffn_up_exps.weight",
            "experts_down": "ffn_down_exps.weight"}),
        ExpertLayout(router="ffn_gate_inp.weight", per_expert={
            "experts_gate": "ffn_gate.{j}.weight", "experts_up": "ffn_up.{j}.weight",
            "experts_down": "ffn_down.{j}.weight"}),
    ))


def checkpoint_shapes(config: Config) -> dict:
    """The per-projection checkpoint tensors' shapes in our layout ([in, out] matmuls): those
    the config has (biases and q/k norms only when it switches them on)."""
    d, f, hd, v = config.hidden_size, config.intermediate_size, config.head_dim, config.vocab_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    layer = {"attn_norm": (d,), "mlp_norm": (d,), "wq": (d, q), "wk": (d, kv), "wv": (d, kv),
             "wo": (q, d), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
    if config.qkv_bias:
        layer.update(bq=(q,), bk=(kv,), bv=(kv,))
    if config.o_bias:
        layer["bo"] = (d,)
    if config.mlp_bias:
        layer.update(b_gate=(f,), b_up=(f,), b_down=(d,))
    if config.qk_norm:
        layer.update(q_norm=(hd,), k_norm=(hd,))
    top = {"embed": (v, d), "final_norm": (d,)}
    if not config.tie_word_embeddings:
        top["lm_head"] = (d, v)
    return {"layer": layer, "top": top}


def fuse_qkv(layer: dict, config: Config, where: str) -> dict:
    """Replace wq/wk/wv ([D, H*hd], [in, out]) and bq/bk/bv by wqkv/bqkv; other keys pass
    through (numpy stays numpy, so a checkpoint is not copied to the device twice).

    QuantizedWeights of one layout fuse into one QuantizedWeight (the same interleave on every
    code plane's and scale's columns); of different layouts (a GGUF Q4_K_M stores attn_v as
    Q6_K beside Q4_K q / k), or beside float weights, they stay Parts: one matmul reads one
    layout."""
    d, hd = config.hidden_size, config.head_dim
    hq, hkv = config.num_heads, config.num_kv_heads
    g = hq // hkv
    want = {"wq": (d, hq * hd), "wk": (d, hkv * hd), "wv": (d, hkv * hd),
            "bq": (hq * hd,), "bk": (hkv * hd,), "bv": (hkv * hd,)}
    for name, shape in want.items():
        if name in layer and tuple(layer[name].shape) != shape:
            raise ValueError(f"{where}: {name} has shape {tuple(layer[name].shape)}, expected "
                             f"{shape} from the config (hidden {d}, heads {hq}/{hkv}, head_dim {hd})")
    missing = [n for n in ("wq", "wk", "wv") if n not in layer]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    out = {k: v for k, v in layer.items() if k not in want}

    def heads(q, k, v, lead: tuple):  # [*lead, Hq*hd], 2x [*lead, Hkv*hd] -> [*lead, Hkv, G+2, hd]
        xp = np if all(isinstance(a, np.ndarray) for a in (q, k, v)) else jnp
        return xp.concatenate([q.reshape(*lead, hkv, g, hd), k.reshape(*lead, hkv, 1, hd),
                               v.reshape(*lead, hkv, 1, hd)], axis=len(lead) + 1)

    ws = [layer[n] for n in ("wq", "wk", "wv")]
    quantized = [isinstance(w, QuantizedWeight) for w in ws]
    if all(quantized) and len({weight_format(w) for w in ws}) == 1:
        def columns(q, k, v):  # each component [R, N]: the same interleave of its columns
            return None if q is None else heads(q, k, v, q.shape[:1]).reshape(q.shape[0], -1)

        wq, wk, wv = ws
        out["wqkv"] = wq.replace(
            planes=tuple(map(columns, wq.planes, wk.planes, wv.planes)),
            **{f: columns(getattr(wq, f), getattr(wk, f), getattr(wv, f))
               for f in ("scale", "offset", "super_scale", "super_offset")},
            out_shape=(hkv, g + 2, hd))
    elif any(quantized):
        # Layouts differ (a GGUF Q4_K_M's q / k in Q4_K, v in Q6_K): kept as parts, each
        # its own matmul, their columns interleaved per KV head as wqkv's.
        out["wqkv"] = Parts(tuple(w if q else Dense(w) for w, q in zip(ws, quantized)),
                            groups=hkv, widths=(g, 1, 1), inner=hd, out_shape=(hkv, g + 2, hd))
    else:
        out["wqkv"] = heads(*ws, (d,))
    biases = [n for n in ("bq", "bk", "bv") if n in layer]
    if biases:
        if len(biases) != 3:
            raise ValueError(f"{where}: has {', '.join(biases)} but not all of bq, bk, bv")
        out["bqkv"] = heads(layer["bq"], layer["bk"], layer["bv"], ())
    return out


FAMILY = Family(
    name="llama", param_specs=param_specs, forward=forward,
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"),
    hf_tensors=HF_TENSORS, gguf_architectures=("llama", "qwen2", "qwen3", "qwen3moe"),
    gguf_tensors=GGUF_TENSORS,
    assemble_layer=fuse_qkv, checkpoint_shapes=checkpoint_shapes)
