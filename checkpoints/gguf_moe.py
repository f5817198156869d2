"""GGUF mixture-of-experts files: the MoE (and DeepSeek MLA) config from the metadata, and the
experts' tensors in our layout. Used by checkpoints/gguf.py.

Architectures and what llama.cpp's convert_hf_to_gguf.py writes for them:
- "llama" with `llama.expert_count` (Mixtral): router `ffn_gate_inp` [E, D], the experts stacked
  `ffn_{gate,up,down}_exps` ([E, F, D], [E, F, D], [E, D, F] in numpy order: [E, out, in]);
  older files hold one tensor per expert, `ffn_gate.{j}` ..., stacked here. q / k rows permuted
  as for any llama file. llama.cpp renormalises the top-k softmax weights.
- "qwen3moe": the same tensors, `expert_feed_forward_length` for F; q / k unpermuted, q / k norms;
  llama.cpp renormalises the top-k weights (Qwen3-MoE's norm_topk_prob, not written).
- "deepseek2" (DeepSeek-V2 / V2-Lite / V3): MLA tensors attn_q or attn_q_a / attn_q_a_norm /
  attn_q_b, attn_kv_a_mqa, attn_kv_a_norm; kv_b_proj split per head into attn_k_b [H, R, Dn]
  (transposed) and attn_v_b [H, Dv, R], or one attn_kv_b [H * (Dn + Dv), R] in files from before
  that split; no q / k permutation (llama.cpp rotates adjacent pairs, as DeepSeek does).
  Metadata: head_count_kv 1 and key/value_length R + Dr / R (the latent "MQA" view), the per-head
  sizes in key_length_mla / value_length_mla (older files: key/value_length themselves);
  leading_dense_block_count, expert_shared_count, expert_weights_scale, expert_weights_norm,
  expert_group_count / expert_group_used_count, expert_gating_func (absent: softmax, as
  llama.cpp reads DeepSeek-V2 files), exp_probs_b (V3's score bias), YaRN's mscale_all_dim as
  rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim. Expert groups are scored as
  transformers does: by their best expert with softmax (V2's group_limited_greedy), their best
  two with sigmoid (V3); llama.cpp takes the best two for both.

Kept quantized, a stacked expert tensor becomes ONE QuantizedWeight whose every array has a
leading expert axis (planes [E, rows, N], scale [E, G, N], ...) and whose static fields describe
one expert's [K, N]: the per-expert `gguf_blocks.repack` results stacked with np.stack.
"""

from __future__ import annotations

import jax
import numpy as np

from checkpoints import gguf_blocks
from jaxinfer.configs import MLAConfig, MoEConfig
from jaxinfer.weights import QuantizedWeight

# gguf.ExpertGatingFuncType values we route with.
GATING = {1: "softmax", 2: "sigmoid"}
# Metadata of MoE variants we do not implement, and the value that asks for nothing.
_UNSUPPORTED = (("expert_group_scale", (1.0,)), ("experts_per_group", (0,)),
                ("expert_chunk_feed_forward_length", (0,)), ("moe_latent_size", (0,)),
                ("interleave_moe_layer_step", (0, 1)), ("nextn_predict_layers", (0,)))
K_B = "attn_k_b.weight"  # DeepSeek's kv_b_proj, split by llama.cpp's converter
V_B = "attn_v_b.weight"


def _refuse_unsupported(meta: dict, arch: str, path) -> None:
    for key, neutral in _UNSUPPORTED:
        value = meta.get(f"{arch}.{key}")
        if value is not None and not isinstance(value, list) and value not in neutral:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} = {value!r} asks for a MoE "
                             "variant that is not supported")


def _gating(meta: dict, arch: str, path, allowed: tuple[str, ...]) -> str:
    key = f"{arch}.expert_gating_func"
    value = meta.get(key, 1)  # absent: softmax (llama.cpp's reading of older DeepSeek-V2 files)
    router = GATING.get(value) if isinstance(value, int) else None
    if router not in allowed:
        raise ValueError(f"{path}: GGUF metadata {key} = {value!r} is not supported for "
                         f"{arch!r} (supported: "
                         f"{', '.join(f'{k} ({v})' for k, v in GATING.items() if v in allowed)})")
    return router


def _moe(path, arch: str, **fields) -> MoEConfig:
    try:
        return MoEConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (from the GGUF {arch}.expert_* metadata)") from None


def llama_moe(meta: dict, arch: str, get, path, num_layers: int,
              tensor_names) -> MoEConfig | None:
    """The MoEConfig of a "llama" (Mixtral) or "qwen3moe" file, None without experts. get(key,
    kind, default, required) reads `{arch}.key`. Layers without a router but with a dense MLP
    (Qwen3-MoE's mlp_only_layers) are the dense ones."""
    experts = get("expert_count", int, 0)
    if not experts:
        if arch == "qwen3moe":
            raise ValueError(f"{path}: a qwen3moe file without {arch}.expert_count")
        return None
    _refuse_unsupported(meta, arch, path)
    _gating(meta, arch, path, ("softmax",))
    for key, neutral in (("expert_shared_count", (0,)), ("expert_group_count", (0, 1)),
                         ("expert_weights_scale", (0.0, 1.0))):
        value = get(key, float, None)
        if value is not None and value not in neutral:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} = {value:g} is not supported "
                             f"for {arch!r} (llama.cpp's {arch} graph has no such routing)")
    size = get("expert_feed_forward_length", int, None)
    if size is None:
        if arch != "llama":
            get("expert_feed_forward_length", int, required=True)
        size = get("feed_forward_length", int, required=True)  # Mixtral: its experts' size
    dense = ()
    if tensor_names is not None:
        dense = tuple(i for i in range(num_layers)
                      if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names
                      and f"blk.{i}.ffn_gate.weight" in tensor_names)
    return _moe(path, arch, num_experts=experts,
                experts_per_token=get("expert_used_count", int, required=True),
                expert_intermediate_size=size, norm_topk_prob=bool(
                    get("expert_weights_norm", bool, True)),
                first_dense_layers=get("leading_dense_block_count", int, 0), dense_layers=dense)


def deepseek2_fields(meta: dict, get, path, heads: int, tensor_names) -> dict:
    """Config fields of a "deepseek2" file: mla, moe, intermediate_size, head_dim,
    num_kv_heads, architecture."""
    arch = "deepseek2"
    rope = get("rope.dimension_count", int, required=True)
    kv_lora = get("attention.kv_lora_rank", int, required=True)
    split = tensor_names is not None and any(n.endswith(K_B) for n in tensor_names)
    key_len = get("attention.key_length_mla", int, None)
    value_len = get("attention.value_length_mla", int, None)
    if key_len is None or value_len is None:
        # Files from before llama.cpp's kv_b split give the per-head sizes as key/value_length.
        key_len = get("attention.key_length", int, required=True)
        value_len = get("attention.value_length", int, required=True)
        if split or key_len == kv_lora + rope:
            raise ValueError(f"{path}: {arch}.attention.key_length_mla / value_length_mla are "
                             f"missing, and key_length {key_len} is the latent's; re-convert the "
                             "model with a current llama.cpp convert_hf_to_gguf.py")
    if key_len <= rope:
        raise ValueError(f"{path}: {arch}.attention.key_length_mla = {key_len} must exceed "
                         f"rope.dimension_count = {rope} (the per-head key is nope + rope)")
    try:
        mla = MLAConfig(kv_lora_rank=kv_lora, qk_nope_head_dim=key_len - rope,
                        qk_rope_head_dim=rope, v_head_dim=value_len,
                        q_lora_rank=get("attention.q_lora_rank", int, None) or None,
                        rope_interleave=True)  # llama.cpp's deepseek2 RoPE: adjacent pairs
    except ValueError as e:
        raise ValueError(f"{path}: {e} (from the GGUF {arch}.attention.* metadata)") from None
    kv_heads = get("attention.head_count_kv", int, 1)
    if kv_heads not in (1, heads):
        raise ValueError(f"{path}: {arch}.attention.head_count_kv = {kv_heads}: MLA files have "
                         f"1 (the latent) or, from older converters, the {heads} heads")
    moe = None
    experts = get("expert_count", int, 0)
    dense = get("leading_dense_block_count", int, 0)
    if experts:
        _refuse_unsupported(meta, arch, path)
        router = _gating(meta, arch, path, ("softmax", "sigmoid"))
        groups = get("expert_group_count", int, 0) or 1
        shared = get("expert_shared_count", int, 0)
        moe = _moe(
            path, arch, num_experts=experts,
            experts_per_token=get("expert_used_count", int, required=True),
            expert_intermediate_size=get("expert_feed_forward_length", int, required=True),
            router=router, norm_topk_prob=bool(get("expert_weights_norm", bool, False)),
            routed_scaling_factor=get("expert_weights_scale", float, 0.0) or 1.0,
            n_group=groups, topk_group=(get("expert_group_used_count", int, 0) or groups),
            # DeepSeek-V3 (sigmoid) scores a group by its best two experts, V2 by its best one
            group_scoring="top2_sum" if router == "sigmoid" else "max",
            score_bias=tensor_names is not None and any(
                n.endswith(".exp_probs_b.bias") for n in tensor_names),
            num_shared_experts=shared,
            shared_intermediate_size=get("expert_shared_feed_forward_length", int, None)
            if shared else None,
            first_dense_layers=dense)
    intermediate = get("feed_forward_length", int, None)
    if intermediate is None and (moe is None or dense):
        get("feed_forward_length", int, required=True)
    v3 = moe is not None and moe.router == "sigmoid"
    return {"mla": mla, "moe": moe, "intermediate_size": intermediate or 1,
            "head_dim": mla.qk_head_dim, "num_kv_heads": heads,
            "architecture": "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"}


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def expert_layout(layouts, prefix: str, tensors):
    """The family's first expert layout whose router and first experts the file has, else the
    first (the current format, so missing tensors are named by its names)."""
    for lay in layouts:
        first = [n.format(j=0) for n in lay.per_expert.values()] + list(lay.fused.values())
        if all(prefix + n in tensors for n in [lay.router, *first]):
            return lay
    return layouts[0]


def expert_shapes(layout, prefix: str, config) -> dict[str, tuple[int, ...]]:
    """GGUF name -> numpy-order shape of a MoE layer's router and experts in `layout`."""
    moe, d = config.moe, config.hidden_size
    e, f = moe.num_experts, moe.expert_intermediate_size
    out_in = {"experts_gate": (f, d), "experts_up": (f, d), "experts_down": (d, f)}
    shapes = {prefix + layout.router: (e, d)}
    if moe.score_bias:
        shapes[prefix + layout.router_bias] = (e,)
    for ours, name in layout.fused.items():
        shapes[prefix + name] = (e, *out_in[ours])
    for ours, pattern in layout.per_expert.items():
        shapes.update({prefix + pattern.format(j=j): out_in[ours] for j in range(e)})
    return shapes


def stack_quantized(qws: list[QuantizedWeight]) -> QuantizedWeight:
    """Per-expert QuantizedWeights of one layout -> one, every array with a leading expert axis
    (the static fields, one expert's, must agree)."""
    return jax.tree.map(lambda *a: np.stack(a), *qws)


def read_experts(tensors, prefix: str, layout, config, keep_quantized: bool, dequantize,
                 repack) -> dict:
    """A MoE layer's params: router [D, E] float32 (router_bias [E]), experts_gate / experts_up
    [E, D, F] and experts_down [E, F, D]: float32 arrays, or with keep_quantized (and a type of
    gguf_blocks) stacked QuantizedWeights. dequantize(tensor) -> float32 numpy in file order;
    repack(tensor, data=None) -> QuantizedWeight [in, out] of the tensor, or of `data`, one
    expert's blocks of it."""
    out = {"router": np.ascontiguousarray(dequantize(tensors[prefix + layout.router]).T)}
    if config.moe.score_bias:
        out["router_bias"] = np.array(dequantize(tensors[prefix + layout.router_bias]))
    e = config.moe.num_experts
    for ours, name in layout.fused.items():
        t = tensors[prefix + name]
        if keep_quantized and t.tensor_type.name in gguf_blocks.BLOCK_TYPES:
            out[ours] = stack_quantized([repack(t, data=t.data[j]) for j in range(e)])
        else:
            out[ours] = np.ascontiguousarray(dequantize(t).transpose(0, 2, 1))  # [E, in, out]
    for ours, pattern in layout.per_expert.items():
        ts = [tensors[prefix + pattern.format(j=j)] for j in range(e)]
        if keep_quantized and len({t.tensor_type.name for t in ts}) == 1 \
                and ts[0].tensor_type.name in gguf_blocks.BLOCK_TYPES:
            out[ours] = stack_quantized([repack(t) for t in ts])
            continue
        stacked = None
        for j, t in enumerate(ts):
            w = dequantize(t)  # [out, in]
            if stacked is None:
                stacked = np.empty((e, *w.shape[::-1]), np.float32)
            stacked[j] = w.T
        out[ours] = stacked
    return out


def kv_b_shapes(prefix: str, config) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes of the split kv_b: attn_k_b [H, R, Dn], attn_v_b [H, Dv, R]."""
    mla, h = config.mla, config.num_heads
    return {prefix + K_B: (h, mla.kv_lora_rank, mla.qk_nope_head_dim),
            prefix + V_B: (h, mla.v_head_dim, mla.kv_lora_rank)}


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """attn_k_b [H, R, Dn] and attn_v_b [H, Dv, R] (float) -> wkv_b [R, H * (Dn + Dv)], per head
    its k_nope then its v columns, as kv_b_proj's rows. k_b's blocks (if it was quantized) run
    along Dn, not along R, our contraction axis: so the joined weight is float."""
    r = k_b.shape[1]
    joined = np.concatenate([k_b.transpose(1, 0, 2), v_b.transpose(2, 0, 1)], axis=-1)
    return np.ascontiguousarray(joined.reshape(r, -1))
