"""The one place that turns per-projection checkpoint tensors into the model's fused layout.

Checkpoints store q, k and v projections separately; the model reads them as one weight
`wqkv` [D, Hkv, G + 2, hd] (G = Hq / Hkv): for KV head j, its G query heads, then its key head,
then its value head. One matmul instead of three (at batch 1 the separate k/v products were
~3x slower per byte on the H200), and sharding the Hkv axis keeps each shard's q, k and v
together for tensor parallelism.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.configs import Config


def fuse_qkv(layer: dict, config: Config, where: str) -> dict:
    """Replace wq/wk/wv ([D, H*hd], [in, out]) and bq/bk/bv by wqkv/bqkv; other keys pass through."""
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
    xp = np if all(isinstance(layer[n], np.ndarray) for n in ("wq", "wk", "wv")) else jnp
    out["wqkv"] = xp.concatenate([layer["wq"].reshape(d, hkv, g, hd),
                                  layer["wk"].reshape(d, hkv, 1, hd),
                                  layer["wv"].reshape(d, hkv, 1, hd)], axis=2)
    biases = [n for n in ("bq", "bk", "bv") if n in layer]
    if biases:
        if len(biases) != 3:
            raise ValueError(f"{where}: has {', '.join(biases)} but not all of bq, bk, bv")
        out["bqkv"] = xp.concatenate([layer["bq"].reshape(hkv, g, hd),
                                      layer["bk"].reshape(hkv, 1, hd),
                                      layer["bv"].reshape(hkv, 1, hd)], axis=1)
    return out
