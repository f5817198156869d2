"""DeepSeek-V2 / V3 config.json -> Config (MLAConfig and MoEConfig), as transformers 5.24 reads it.

Fields whose value asks for something we do not implement raise ValueError naming the field:
attention / MLP biases, a router (scoring_func, topk_method) other than the architecture's,
V2's norm_topk_prob (transformers' V2 ignores it where DeepSeek's own code renormalises: there
is no one answer to match), GQA (num_key_value_heads != num_attention_heads).
"""

from __future__ import annotations

import json
import pathlib
import re

from jaxinfer.configs import Config, MLAConfig, MoEConfig

# DeepSeek-V3 checkpoints carry num_nextn_predict_layers multi-token-prediction modules as
# layers past num_hidden_layers: the model's load skips them (transformers does not build them
# either); `read_mtp` reads the first as a speculative draft head (--speculative mtp).
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# An MTP module's own tensors under model.layers.{num_layers}. (read_mtp): our name in a draft
# head (jaxinfer/draft_head.py) -> (the name, whether to transpose it to [in, out]).
MTP_TENSORS = {"enorm": ("enorm.weight", False), "hnorm": ("hnorm.weight", False),
               "fc": ("eh_proj.weight", True), "norm": ("shared_head.norm.weight", False),
               "head": ("shared_head.head.weight", True)}


def is_mtp_tensor(name: str, config: Config) -> bool:
    """Whether a checkpoint tensor belongs to a layer past the model's (a V3 MTP module)."""
    m = _LAYER.match(name)
    return config.family == "deepseek" and m is not None and int(m.group(1)) >= config.num_layers


def _refuse(path, field: str, value, why: str):
    raise ValueError(f"{path}: {field}={value!r}: {why}")


def _moe(cfg: dict, v3: bool, path) -> MoEConfig | None:
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts", cfg.get("num_experts")))
    if not experts:
        return None
    scoring = cfg.get("scoring_func")
    method = cfg.get("topk_method")
    if v3:
        if scoring not in (None, "sigmoid"):
            _refuse(path, "scoring_func", scoring, "DeepSeek-V3 routes with 'sigmoid' only")
        if method not in (None, "noaux_tc"):
            _refuse(path, "topk_method", method, "DeepSeek-V3 routes with 'noaux_tc' only")
        n_group, topk_group = cfg.get("n_group", 8) or 1, cfg.get("topk_group", 4) or 1
        router = dict(router="sigmoid", score_bias=True, group_scoring="top2_sum",
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
    else:
        if scoring not in (None, "softmax"):
            _refuse(path, "scoring_func", scoring, "DeepSeek-V2 routes with 'softmax' only")
        if method not in (None, "greedy", "group_limited_greedy"):
            _refuse(path, "topk_method", method,
                    "supported: 'greedy', 'group_limited_greedy'")
        if cfg.get("norm_topk_prob"):
            _refuse(path, "norm_topk_prob", cfg["norm_topk_prob"],
                    "transformers' DeepseekV2 ignores it while DeepSeek's code renormalises "
                    "the top-k weights; not supported")
        grouped = method == "group_limited_greedy"
        n_group = (cfg.get("n_group") or 1) if grouped else 1
        topk_group = (cfg.get("topk_group") or 1) if grouped else 1
        router = dict(router="softmax", group_scoring="max")
    default_shared, default_dense = (1, 3) if v3 else (2, 0)
    fields = dict(
        num_experts=int(experts), experts_per_token=cfg.get("num_experts_per_tok"),
        expert_intermediate_size=cfg.get("moe_intermediate_size"),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        n_group=int(n_group), topk_group=int(topk_group),
        num_shared_experts=int(cfg.get("n_shared_experts", default_shared) or 0),
        first_dense_layers=int(cfg.get("first_k_dense_replace", default_dense) or 0), **router)
    for key, ours in (("num_experts_per_tok", "experts_per_token"),
                      ("moe_intermediate_size", "expert_intermediate_size")):
        if fields[ours] is None:
            raise ValueError(f"{path}: config.json has {experts} routed experts but no {key!r}")
    try:
        return MoEConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (from config.json n_routed_experts={experts}, "
                         f"num_experts_per_tok={fields['experts_per_token']}, n_group="
                         f"{cfg.get('n_group')}, topk_group={cfg.get('topk_group')})") from None


def config_from_hf(cfg: dict, arch: str, path: pathlib.Path) -> Config:
    """A DeepseekV2ForCausalLM / DeepseekV3ForCausalLM config.json (as a dict) -> Config."""
    from checkpoints.hf import _require, _rope_from_hf

    v3 = arch == "DeepseekV3ForCausalLM"
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            _refuse(path, field, cfg[field], "biases are not supported in the DeepSeek family")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        _refuse(path, "hidden_act", act, "the MLPs are SwiGLU (silu) only")
    heads = int(_require(cfg, "num_attention_heads", path))
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        _refuse(path, "num_key_value_heads", kv_heads,
                f"MLA expands its latent to all {heads} heads (it must equal "
                f"num_attention_heads)")
    q_lora = cfg.get("q_lora_rank")
    try:
        mla = MLAConfig(
            kv_lora_rank=_require(cfg, "kv_lora_rank", path),
            qk_nope_head_dim=_require(cfg, "qk_nope_head_dim", path),
            qk_rope_head_dim=_require(cfg, "qk_rope_head_dim", path),
            v_head_dim=_require(cfg, "v_head_dim", path), q_lora_rank=q_lora,
            # V2 always rotates interleaved pairs; V3 unless rope_interleave is false
            rope_interleave=bool(cfg.get("rope_interleave", True)) if v3 else True)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    theta, rope_scaling = _rope_from_hf(cfg)
    eos = cfg.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    moe = _moe(cfg, v3, path)
    intermediate = cfg.get("intermediate_size")
    layers = int(_require(cfg, "num_hidden_layers", path))
    if intermediate is None and (moe is None or moe.first_dense_layers):
        _require(cfg, "intermediate_size", path)
    return Config(
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=int(_require(cfg, "hidden_size", path)),
        intermediate_size=int(intermediate or 1),
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=mla.qk_head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        family="deepseek", architecture=arch,
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos, mla=mla, moe=moe)


def read_mtp(source: str, config: Config, block_config: Config) -> dict:
    """The first MTP module of a DeepSeek-V3 HF checkpoint directory -> a draft head's params
    (jaxinfer/draft_head.py): enorm, hnorm [D]; fc [2D, D] (eh_proj, over [embedding |
    hidden]); the block as a layer of block_config (a one-layer config); norm [D] and head
    [D, V] (shared_head). ValueError when the checkpoint has none."""
    from checkpoints import fp8_blocks
    from checkpoints.hf import LazyTensors, _read_experts, _safetensors_files
    from jaxinfer.models import registry

    path = pathlib.Path(source)
    prefix = f"model.layers.{config.num_layers}."
    if not path.is_dir():
        raise ValueError(f"{path}: MTP weights are read from an HF safetensors checkpoint "
                         "directory, not a single file")
    files = _safetensors_files(path)
    cfg = json.loads((path / "config.json").read_text())
    block = fp8_blocks.block_size(cfg, path / "config.json")
    tensors = fp8_blocks.Fp8BlockTensors(files, block) if block is not None \
        else LazyTensors(files)
    if prefix + "eh_proj.weight" not in tensors:
        raise ValueError(f"{path} has no MTP weights ({prefix}eh_proj.weight is absent; "
                         f"config.json num_nextn_predict_layers="
                         f"{cfg.get('num_nextn_predict_layers', 0)}); --speculative mtp needs "
                         "a DeepSeek-V3 checkpoint that keeps them")
    where = f"{path}: the MTP module {prefix[:-1]}"

    def take(name: str, transpose: bool):
        t = tensors[name]
        return t.T if transpose else t

    out = {}
    for ours, (name, transpose) in MTP_TENSORS.items():
        if prefix + name not in tensors:
            raise ValueError(f"{where}: missing {prefix + name}")
        out[ours] = take(prefix + name, transpose)
    family = registry.family(block_config)
    layer = {ours: take(prefix + hf, tr) for ours, (hf, tr) in family.hf_tensors.layer.items()
             if prefix + hf in tensors}
    if block_config.is_moe_layer(0):
        layer.update(_read_experts(tensors, prefix, family.hf_tensors.experts, block_config,
                                   take, where))
    out["layer"] = family.assemble_layer(layer, block_config, where)
    return out
