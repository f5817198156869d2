"""The Gemma family: Gemma 2 and the Gemma 3 text tower.

What sets it apart from Llama, all switches on `Config` set by the converters in checkpoints/:
embeddings times sqrt(hidden) (rounded to the dtype first, as HF does), RMSNorms that scale by
(1 + weight) in float32 (`norm_offset`), sandwich norms (a post-norm on each sublayer's output
before the residual add, besides the pre-norms), GeGLU (tanh-approximated GELU gate), softmax
scale query_pre_attn_scalar^-0.5, attention-logit and final-logit soft-capping (Gemma 2), q/k
RMSNorm (Gemma 3), sliding-window layers interleaved with full ones, Gemma 3's sliding layers on
their own unscaled RoPE base (`rope_local_theta`), tied embeddings.

The forward is a wiring diagram of the same ops as llama.py; the layer loop is unrolled for the
same reason (per-step weight copies under lax.scan, benchmarks/DECISIONS.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import ops
from jaxinfer.cache import KVCache
from jaxinfer.configs import Config, RopeScaling
from jaxinfer.models import llama
from jaxinfer.models.family import Family, TensorMap
from jaxinfer.ops import reference
from jaxinfer.plan import Plan
from jaxinfer.weights import ParamSpec


def param_specs(config: Config) -> dict:
    """Llama's weights plus the two post-norms per layer; every norm weight starts at zero
    (its scale is 1 + weight)."""
    specs = llama.param_specs(config)
    d = config.hidden_size
    for layer in specs["layers"]:
        for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
            if name in layer:
                layer[name] = ParamSpec(layer[name].shape, layer[name].axes, "zeros")
        layer["post_attn_norm"] = ParamSpec((d,), ("embed",), "zeros")
        layer["post_mlp_norm"] = ParamSpec((d,), ("embed",), "zeros")
    specs["final_norm"] = ParamSpec((d,), ("embed",), "zeros")
    return specs


def local_rope_config(config: Config) -> Config:
    """The config whose RoPE tables the sliding-window layers use: Gemma 3's local base,
    without the global layers' scaling."""
    return config.replace(rope_theta=config.rope_local_theta, rope_scaling=RopeScaling(),
                          rope_freq_factors=())


def forward(params: dict, tokens: jax.Array, positions: jax.Array, plan: Plan,
            cache: KVCache | None = None, logits_at: jax.Array | None = None,
            fresh: bool = False, embeds: jax.Array | None = None,
            hidden: bool = False) -> tuple:
    """Causal forward pass; arguments and results as llama.forward's."""
    config = plan.config
    b, t = tokens.shape
    rope_global = ops.rope_tables(config, positions)  # cos, sin [B, T, hd]
    rope_local = rope_global if config.rope_local_theta is None else ops.rope_tables(
        local_rope_config(config), positions)
    x = ops.embed(params["embed"], tokens, plan) if embeds is None else embeds  # [B, T, D]
    if config.embed_scale is not None and embeds is None:
        x = x * jnp.asarray(config.embed_scale, x.dtype)  # the normalizer rounded first (HF)
    stream = ops.Residual.start(x)
    new_cache = []
    for i, lp in enumerate(params["layers"]):
        window = config.window(i)
        with jax.named_scope(f"layer{i}"):
            stream, qkv = ops.norm_linear(stream, lp["attn_norm"], lp["wqkv"], plan)
            o, layer_cache = ops.attend(
                qkv, None if cache is None else cache.layer(i), plan, positions=positions,
                rope=rope_global if window is None else rope_local, window=window,
                q_norm=lp.get("q_norm"), k_norm=lp.get("k_norm"), fresh=fresh,
                sm_scale=config.attn_scale, softcap=config.attn_softcap)  # o [B, T, Hq, hd]
            stream = ops.linear(o.reshape(b, t, -1), lp["wo"], plan, into=stream,
                                post_norm=lp["post_attn_norm"])
            stream = ops.gated_mlp(stream, lp["mlp_norm"], lp["w_gate"], lp["w_up"],
                                   lp["w_down"], plan, post_norm=lp["post_mlp_norm"])
            new_cache.append(layer_cache)
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    out = ops.lm_head(stream, params["final_norm"], head, plan, rows_at=logits_at,
                      hidden=hidden)
    logits, h = out if hidden else (out, None)
    logits = reference.soft_cap(logits, config.final_softcap)  # [B, T or 1, V] float32
    cache = None if cache is None else cache.with_layers(new_cache)
    return (logits, cache, h) if hidden else (logits, cache)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

_HF_NORMS = {
    "attn_norm": ("input_layernorm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
HF_TENSORS = TensorMap(
    layer={**{k: v for k, v in llama.HF_TENSORS.layer.items()
              if k in ("wq", "wk", "wv", "wo", "q_norm", "k_norm", "w_gate", "w_up", "w_down")},
           **_HF_NORMS},
    top=dict(llama.HF_TENSORS.top))

# gguf's TENSOR_NAMES for MODEL_ARCH.GEMMA2 / GEMMA3 (".weight" as the converter appends it).
# llama.cpp's converter stores every Gemma norm weight with the 1 already added
# (checkpoints/gguf.py takes it off again, once, on load).
GGUF_TENSORS = TensorMap(
    layer={**{k: v for k, v in llama.GGUF_TENSORS.layer.items()
              if k in ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                       "w_gate", "w_up", "w_down")},
           "post_attn_norm": ("post_attention_norm.weight", False),
           "post_mlp_norm": ("post_ffw_norm.weight", False)},
    top=dict(llama.GGUF_TENSORS.top))

# Our norm params of a Gemma layer and at the top (GGUF files hold these as 1 + weight).
NORM_PARAMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm",
               "final_norm")


def checkpoint_shapes(config: Config) -> dict:
    shapes = llama.checkpoint_shapes(config)
    d = config.hidden_size
    shapes["layer"].update(post_attn_norm=(d,), post_mlp_norm=(d,))
    return shapes


FAMILY = Family(
    name="gemma", param_specs=param_specs, forward=forward,
    hf_architectures=("Gemma2ForCausalLM", "Gemma3ForCausalLM",
                      "Gemma3ForConditionalGeneration"),
    hf_tensors=HF_TENSORS, gguf_architectures=("gemma2", "gemma3"),
    gguf_tensors=GGUF_TENSORS,
    assemble_layer=llama.fuse_qkv, checkpoint_shapes=checkpoint_shapes)
