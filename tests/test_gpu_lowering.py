"""The GPU kernels and the model's GPU decode path lowered for an H200 on the CPU.

Interpret mode (the other kernel tests) runs a kernel's logic but never lowers it, so a block
shape Triton rejects, an op the Mosaic GPU lowering lacks, or a wiring error that only the GPU
dispatch reaches would pass CI and fail on the first GPU call. Here `jax.export` lowers for the
"cuda" platform under an abstract H200 (no GPU needed: Pallas Triton takes the compute
capability from the abstract device, Mosaic GPU emits its kernel in Python): each kernel at the
benchmark shapes, and the Llama-3-8B decode step with the model's dispatch forced onto the
kernels, where the lowered module also says which kernels a layer runs. Every Pallas Triton
module is also run through the MLIR verifier, as XLA does when it parses it on the GPU (an
atomic whose value type differs from its pointer's passed interpret mode and failed only
there, session 6). What this cannot catch: Triton's and ptxas' own passes (they run in XLA's
GPU compiler) and anything numeric (the GPU tests, `pytest -m gpu`, run those on the H200).
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh

import pallas_kernels as pk
from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS
from jaxinfer.models import llama
from jaxinfer.plan import At, Boundary, KernelPolicy, Kernels, Plan, Prefetch
from jaxinfer.weights import abstract_params
from pallas_kernels._jax_private import triton_lowering  # to verify its modules

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture(autouse=True)
def verify_triton_modules(monkeypatch):
    """Every Triton module Pallas lowers here goes through the MLIR verifier (raises on an
    op that XLA's parser would reject). Yields the modules' texts, in lowering order."""
    real = triton_lowering.lower_jaxpr_to_triton_module
    seen = []

    def lower_and_verify(*args, **kwargs):
        result = real(*args, **kwargs)
        result.module.operation.verify()
        seen.append(str(result.module))
        return result

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
    yield seen


def lower_for_h200(fn, *args) -> str:
    """fn(*args) (abstract args) lowered for CUDA on an abstract H200 -> the StableHLO text."""
    with jax.sharding.use_abstract_mesh(H200):
        exported = export.export(
            jax.jit(fn), platforms=("cuda",),
            # XLA compiles the Triton IR itself; the export only needs the lowering.
            disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return exported.mlir_module()


def kernel_names(module: str) -> collections.Counter:
    """Names of the Pallas kernels in a lowered module, one count per distinct lowering (a
    jitted kernel wrapper called twice with the same shapes is emitted once)."""
    calls = re.findall(r"custom_call @[^\n]*", module)  # one line per kernel call site
    return collections.Counter(n for c in calls for n in re.findall(r'name = "(\w+)"', c))


KERNEL_CASES = {
    # name: (fn, abstract args) at the shapes benchmarks/kernels.py and the 8B step use
    "norm_matmul q/k/v partials": (
        lambda x, w: pk.norm_matmul(x, None, w, partials=True),
        (S((1, 4096), BF16), S((4096, 8, 6, 128), BF16))),
    "norm_matmul norm + residual": (
        lambda x, n, w, r: pk.norm_matmul(x, n, w, residual=r),
        (S((16, 4096), BF16), S((4096,), BF16), S((4096, 4096), BF16), S((16, 4096), BF16))),
    "swiglu": (lambda x, g, u: pk.swiglu(x, g, u),
               (S((1, 4096), BF16), S((4096, 14336), BF16), S((4096, 14336), BF16))),
    "swiglu norm": (lambda x, n, g, u: pk.swiglu(x, g, u, norm_weight=n),
                    (S((16, 4096), BF16), S((4096,), BF16), S((4096, 14336), BF16),
                     S((4096, 14336), BF16))),
    "rms_norm": (lambda x, w: pk.rms_norm(x, w, eps=1e-5), (S((16384, 4096), BF16),
                                                           S((4096,), BF16))),
    "add_rms_norm": (lambda x, d, w: pk.add_rms_norm(x, d, w, eps=1e-5),
                     (S((1, 1, 4096), BF16), S((4, 1, 1, 4096), F32), S((4096,), BF16))),
    "moe_route mixtral": (lambda h, r: pk.moe_route(h, r, k=2, norm_topk_prob=True),
                          (S((1, 4096), BF16), S((4096, 8), F32))),
    "moe_route qwen3-30b-a3b 4 rows": (lambda h, r: pk.moe_route(h, r, k=8, norm_topk_prob=True),
                                       (S((4, 2048), BF16), S((2048, 128), F32))),
    "add_rms_norm_route mixtral": (
        lambda x, d, n, r: pk.add_rms_norm_route(x, d, n, r, eps=1e-5, k=2, norm_topk_prob=True),
        (S((1, 4096), BF16), S((4, 1, 4096), F32), S((4096,), BF16), S((4096, 8), F32))),
    "moe_route qwen3-30b-a3b in 16 blocks": (
        lambda h, r: pk.moe_route(h, r, k=8, norm_topk_prob=True, blocks=16),
        (S((1, 2048), BF16), S((2048, 128), F32))),
    "add_rms_norm_route deepseek-v2-lite in 8 blocks": (
        lambda x, d, n, r: pk.add_rms_norm_route(x, d, n, r, eps=1e-6, k=6, blocks=8),
        (S((1, 2048), BF16), S((4, 1, 2048), F32), S((2048,), BF16), S((2048, 64), F32))),
    "rope": (lambda x, p, f: pk.rope(x, p, f),
             (S((4, 4096, 32, 128), BF16), S((4, 4096), I32), S((64,), F32))),
    "decode_attention B8 S8k": (
        lambda q, k, v, n: pk.decode_attention(q, k, v, n),
        (S((8, 32, 128), BF16), S((8, 8192, 8, 128), BF16), S((8, 8192, 8, 128), BF16),
         S((8,), I32))),
    "append unsplit, chunks": (
        lambda qkv, k, v, p, c, s: pk.decode_attention_append(qkv, k, v, p, rope=(c, s)),
        (S((2, 1, 8, 6, 128), F32), S((1, 512, 8, 128), BF16), S((1, 512, 8, 128), BF16),
         S((1,), I32), S((1, 128), F32), S((1, 128), F32))),
    "append split, window": (
        lambda qkv, k, v, p: pk.decode_attention_append(qkv, k, v, p, sliding_window=4096),
        (S((64, 8, 6, 128), BF16), S((64, 8192, 8, 128), BF16), S((64, 8192, 8, 128), BF16),
         S((64,), I32))),
    "append chunks, deferred norm": (
        lambda qkv, ss, k, v, p, c, s: pk.decode_attention_append(
            qkv, k, v, p, rope=(c, s), norm=(ss, 4096, 1e-5)),
        (S((2, 1, 8, 6, 128), F32), S((2, 1), F32), S((1, 512, 8, 128), BF16),
         S((1, 512, 8, 128), BF16), S((1,), I32), S((1, 128), F32), S((1, 128), F32))),
    "swiglu norm + deltas": (
        lambda x, d, n, g, u: pk.swiglu(x, g, u, norm_weight=n, deltas=d),
        (S((1, 4096), BF16), S((4, 1, 4096), F32), S((4096,), BF16), S((4096, 14336), BF16),
         S((4096, 14336), BF16))),
    "norm_matmul norm + deltas, partials": (
        lambda x, d, n, w: pk.norm_matmul(x, n, w, deltas=d, partials=True),
        (S((1, 4096), BF16), S((4, 1, 4096), F32), S((4096,), BF16), S((4096, 8, 6, 128), BF16))),
    "norm_matmul tied head (transposed), deltas, one-row math off": (
        lambda x, d, n, w: pk.norm_matmul(x, n, w, deltas=d, transposed=True,
                                          out_dtype=jnp.float32, single_row=False),
        (S((1, 576), BF16), S((1, 1, 576), F32), S((576,), BF16), S((49152, 576), BF16))),
    "append fixed-size chunks (batch-invariant)": (
        lambda qkv, k, v, p: pk.decode_attention_append(
            qkv, k, v, p, block_sizes=pk.DecodeBlockSizes(block_k=128, num_stages=3,
                                                          split_keys=512)),
        (S((4, 8, 6, 128), BF16), S((4, 8192, 8, 128), BF16), S((4, 8192, 8, 128), BF16),
         S((4,), I32))),
    "flash triton causal": (
        lambda q, k, v: pk.flash_attention(q, k, v, causal=True, backend="triton"),
        (S((4, 4096, 32, 128), BF16), S((4, 4096, 8, 128), BF16), S((4, 4096, 8, 128), BF16))),
}
for _d in (64, 128, 256):
    for _causal in (True, False):
        KERNEL_CASES[f"flash mosaic d{_d} {'causal' if _causal else 'full'}"] = (
            lambda q, k, v, c=_causal: pk.flash_attention(q, k, v, causal=c, backend="mosaic"),
            (S((4, 4096, 32, _d), BF16), S((4, 4096, 8, _d), BF16), S((4, 4096, 8, _d), BF16)))
KERNEL_CASES["flash mosaic ragged window"] = (
    lambda q, k, v: pk.flash_attention(q, k, v, causal=True, sliding_window=1000,
                                       backend="mosaic"),
    (S((1, 1000, 16, 128), BF16), S((1, 3000, 4, 128), BF16), S((1, 3000, 4, 128), BF16)))
# The opt-in wgmma overlaps of the flash kernel (MosaicFlashConfig.overlap) at the D128 bench
# shapes: the pipelined variant carries a second accumulator through the KV loops and issues two
# products in one accumulator scope, which only the real lowering exercises; "qk_pv_intra" keeps
# O in an accumulator across the loops, loads S with wgmma.wait_group 1 and stores the rescaled
# O back (interpret mode keeps O in registers instead); wg_ranges adds the skipped-tile loops.
for _overlap, _pingpong, _wgr in (("qk_pv", True, False),
                                  ("qk_pv", False, False), ("qk_pv_intra", False, False),
                                  ("qk_pv_intra", True, False), ("qk_pv", False, True),
                                  ("qk_pv_intra", False, True), ("none", True, True)):
    _cfg = pk.MosaicFlashConfig(64, 128, 2, _pingpong, overlap=_overlap, wg_ranges=_wgr)
    for _causal in (True, False):
        KERNEL_CASES[f"flash mosaic d128 {'causal' if _causal else 'full'} {_cfg}"] = (
            lambda q, k, v, c=_causal, cfg=_cfg: pk.flash_attention(
                q, k, v, causal=c, backend="mosaic", mosaic_config=cfg),
            (S((4, 4096, 32, 128), BF16), S((4, 4096, 8, 128), BF16),
             S((4, 4096, 8, 128), BF16)))
for _cfg in (pk.MosaicFlashConfig(overlap="qk_pv"),
             pk.MosaicFlashConfig(64, 64, 2, False, overlap="qk_pv_intra", wg_ranges=True)):
    KERNEL_CASES[f"flash mosaic ragged window {_cfg}"] = (
        lambda q, k, v, cfg=_cfg: pk.flash_attention(
            q, k, v, causal=True, sliding_window=1000, backend="mosaic", mosaic_config=cfg),
        (S((1, 1000, 16, 128), BF16), S((1, 3000, 4, 128), BF16), S((1, 3000, 4, 128), BF16)))

# Gemma: head_dim 256 (Gemma 2 2B / 9B, Gemma 3 1B-12B) with Gemma 2's soft-capping, at 16-32
# query heads, and Gemma 3 27B's GeGLU (hidden 5376, 21504), at the kernels' default blocks.
KERNEL_CASES.update({
    "gemma flash triton d256 softcap window": (
        lambda q, k, v: pk.flash_attention(q, k, v, sliding_window=1024, softcap=50.0,
                                           sm_scale=168 ** -0.5),
        (S((1, 2048, 32, 256), BF16), S((1, 2048, 16, 256), BF16), S((1, 2048, 16, 256), BF16))),
    "gemma decode d256 softcap S8k": (
        lambda q, k, v, n: pk.decode_attention(q, k, v, n, softcap=50.0),
        (S((1, 32, 256), BF16), S((1, 8192, 16, 256), BF16), S((1, 8192, 16, 256), BF16),
         S((1,), I32))),
    "gemma append d256 softcap unsplit": (
        lambda qkv, k, v, p, c, s: pk.decode_attention_append(qkv, k, v, p, rope=(c, s),
                                                              softcap=50.0),
        (S((1, 8, 4, 256), BF16), S((1, 512, 8, 256), BF16), S((1, 512, 8, 256), BF16),
         S((1,), I32), S((1, 256), F32), S((1, 256), F32))),
    "gemma append d256 softcap split window": (
        lambda qkv, k, v, p, c, s: pk.decode_attention_append(
            qkv, k, v, p, rope=(c, s), softcap=50.0, sliding_window=4096),
        (S((1, 16, 4, 256), BF16), S((1, 8192, 16, 256), BF16), S((1, 8192, 16, 256), BF16),
         S((1,), I32), S((1, 256), F32), S((1, 256), F32))),
    "gemma chunk d256 softcap": (
        lambda q, k, v, p: pk.chunk_attention(q, k, v, p, softcap=50.0),
        (S((1, 256, 16, 256), BF16), S((1, 4096, 8, 256), BF16), S((1, 4096, 8, 256), BF16),
         S((1, 256), I32))),
    "gemma geglu": (lambda x, g, u: pk.swiglu(x, g, u, activation="gelu_tanh"),
                    (S((1, 5376), BF16), S((5376, 21504), BF16), S((5376, 21504), BF16))),
})

# The MoE experts kernels at Mixtral's (E 8, k 2, D 4096, F 14336) and Qwen3-30B-A3B's (E 128,
# k 8, D 2048, F 768) shapes: the expert read from an int32 map inside the kernel.
for _name, _n, (_d, _f, _e, _k) in (("decode mixtral", 1, (4096, 14336, 8, 2)),
                                    ("decode qwen3", 4, (2048, 768, 128, 8)),
                                    ("grouped mixtral prefill", 8192, (4096, 14336, 8, 2)),
                                    ("grouped qwen3 32 tokens", 32, (2048, 768, 128, 8))):
    KERNEL_CASES[f"moe {_name}"] = (
        pk.moe_decode if _name.startswith("decode") else pk.moe_grouped,
        (S((_n, _d), BF16), S((_n, _k), F32), S((_n, _k), I32), S((_e, _d, _f), BF16),
         S((_e, _d, _f), BF16), S((_e, _f, _d), BF16)))


# The Mosaic GPU int4 matmul (codes [N, K] int4, fp16 scales [K / 128, N]) at decode rows, in
# its default configuration for each shape.
for _m, _k, _n in ((1, 4096, 14336), (16, 14336, 4096), (1, 4096, 6144)):
    KERNEL_CASES[f"int4 mosaic {_m}x{_k}x{_n}"] = (
        lambda x, c, s: pk.quantized_matmul_mgpu(
            x, pk.QuantizedWeight(planes=(c,), scale=s, k=c.shape[1], out_shape=(c.shape[0],),
                                  bits=(4,), group=128, code_offset=8, layout="nk")),
        (S((_m, _k), BF16), S((_n, _k), jnp.int4), S((_k // 128, _n), jnp.float16)))
KERNEL_CASES["int8 mosaic"] = (
    lambda x, c, s: pk.quantized_matmul_mgpu(
        x, pk.QuantizedWeight(planes=(c,), scale=s, k=4096, out_shape=(14336,), bits=(8,),
                              group=128, layout="nk")),
    (S((1, 4096), BF16), S((14336, 4096), jnp.int8), S((32, 14336), jnp.float16)))
KERNEL_CASES["fp8 mosaic"] = (  # e4m3 -> f16 -> bf16 in registers (no direct e4m3 -> bf16)
    lambda x, c, s: pk.quantized_matmul_mgpu(
        x, pk.QuantizedWeight(planes=(c,), scale=s, k=4096, out_shape=(14336,), bits=(8,),
                              group=128, layout="nk")),
    (S((1, 4096), BF16), S((14336, 4096), jnp.float8_e4m3fn), S((32, 14336), jnp.float32)))

# The same kernel for the other formats the nk layout takes (quantized_mgpu.nk_unfit): groups
# of 16 to 64, offsets (x's group sums, a column broadcast), two-level scales computed in the
# kernel, 5- / 6-bit codes as int8. name: (codes, bits, group, super_group, code_offset, scale,
# offset, super_scale, super_offset dtypes), as checkpoints/gguf_blocks.repack makes them.
F16, U8, I8 = jnp.float16, jnp.uint8, jnp.int8
NK_FORMATS = {
    "Q8_0": (I8, (8,), 32, 0, 0, F16, None, None, None),
    "Q4_0": (jnp.int4, (4,), 32, 0, 8, F16, None, None, None),
    "Q4_1": (jnp.int4, (4,), 32, 0, 0, F16, F16, None, None),
    "Q5_0": (I8, (4, 1), 32, 0, 16, F16, None, None, None),
    "Q5_1": (I8, (4, 1), 32, 0, 0, F16, F16, None, None),
    "Q4_K": (jnp.int4, (4,), 32, 256, 0, U8, U8, F16, F16),
    "Q5_K": (I8, (4, 1), 32, 256, 0, U8, U8, F16, F16),
    "Q6_K": (I8, (4, 2), 16, 256, 32, I8, None, F16, None),
    "int4 asym g64": (jnp.int4, (4,), 64, 0, 0, F16, F16, None, None),
    "int4 g128": (jnp.int4, (4,), 128, 0, 8, F16, None, None, None),
}


def nk_case(fmt: str, m: int, k: int, ns: tuple, cfg=None, experts: tuple = (),
            deltas: int | None = None):
    """(fn, abstract args): x [m, k] @ one weight per N in ns of format fmt (several: one
    launch, as gate and up), in configuration cfg (None: the default). experts = (E, A): each
    weight E stacked experts, A token-expert assignments (a MoE decode). deltas: the boundary
    in the kernel (a norm weight, that many float32 deltas)."""
    codes, bits, group, sg, code_offset, *dtypes = NK_FORMATS[fmt]
    rows = (k // group, k // group, k // max(sg, 1), k // max(sg, 1))
    fields = ("scale", "offset", "super_scale", "super_offset")
    have = [f for f, dt in zip(fields, dtypes) if dt is not None]
    lead = experts[:1]
    args = [S((m, k), BF16)] + ([S((experts[1],), I32)] * 2 if experts else [])
    if deltas is not None:
        args += [S((k,), BF16), S((deltas, m, k), F32)]
    for n in ns:
        args += [S((*lead, n, k), codes)] + [S((*lead, r, n), dt)
                                             for r, dt in zip(rows, dtypes) if dt is not None]

    def fn(x, *arrays):
        routing, arrays = (arrays[:2], arrays[2:]) if experts else (None, arrays)
        boundary, arrays = (arrays[:2], arrays[2:]) if deltas is not None else ((None, None),
                                                                               arrays)
        per = 1 + len(have)
        ws = tuple(pk.QuantizedWeight(
            planes=(arrays[i],), **dict(zip(have, arrays[i + 1:i + per])), k=k,
            out_shape=(arrays[i].shape[-2],), bits=bits, group=group, super_group=sg,
            code_offset=code_offset, layout="nk", frag=bool(cfg and cfg.frag))
            for i in range(0, len(arrays), per))
        if deltas is None:
            return pk.quantized_matmul_mgpu(x, ws, cfg=cfg, experts=routing)
        return pk.quantized_matmul_mgpu(x, ws, cfg=cfg, norm_weight=boundary[0], eps=1e-5,
                                        deltas=boundary[1] if deltas else None, partials=True)
    return fn, tuple(args)


for _fmt in NK_FORMATS:
    KERNEL_CASES[f"{_fmt} mosaic 1x4096x14336"] = nk_case(_fmt, 1, 4096, (14336,))
for _fmt, _m in (("Q4_K", 16), ("Q6_K", 16), ("int4 asym g64", 64)):  # M 64: waits per 2
    KERNEL_CASES[f"{_fmt} mosaic {_m}x14336x4096"] = nk_case(_fmt, _m, 14336, (4096,))
KERNEL_CASES["int4 asym g64 mosaic gate+up 1x4096x2x14336"] = nk_case("int4 asym g64", 1, 4096,
                                                              (14336, 14336))
# MoE decode: each block reads its assignment's expert id, then that expert's rows (Mixtral's
# gate + up for one token's two experts; Qwen3-30B-A3B's down for 4 tokens x 8 experts).
KERNEL_CASES["int4 g128 mosaic experts gate+up 1x4096x2x14336"] = nk_case(
    "int4 g128", 1, 4096, (14336, 14336), experts=(8, 2))
KERNEL_CASES["Q4_K mosaic experts down 32x768x2048"] = nk_case(
    "Q4_K", 32, 768, (2048,), experts=(128, 32))
KERNEL_CASES["int4 g128 mosaic fragment order 1x4096x14336"] = nk_case(  # no relayout
    "int4 g128", 1, 4096, (14336,), pk.MgpuMatmulConfig(gps=2, stages=4, splits=4, frag=True))
# The sublayer boundary in the kernel's main loop (norm_weight, deltas): x + deltas and the
# normed x per K step, stored back into x's swizzled tile for the wgmma (gate + up at one row
# with four K ranges' deltas, q/k/v at 8 rows with two, the norm alone).
for _m, _nd, _ns in ((1, 4, (14336, 14336)), (8, 2, (6144,)), (3, 0, (4096,))):
    def _boundary(x, nw, d, *arrays, nd=_nd):
        return pk.quantized_matmul_mgpu(
            x, tuple(pk.QuantizedWeight(planes=(c,), scale=s, k=4096, out_shape=(c.shape[0],),
                                        bits=(4,), group=128, code_offset=8, layout="nk",
                                        frag=True)
                     for c, s in zip(arrays[::2], arrays[1::2])),
            norm_weight=nw, eps=1e-5, deltas=d if nd else None, partials=True)
    KERNEL_CASES[f"int4 g128 mosaic boundary {_m}x4096x{'+'.join(map(str, _ns))} "
                 f"{_nd} deltas"] = (_boundary, (
                     S((_m, 4096), BF16), S((4096,), BF16), S((max(_nd, 1), _m, 4096), F32),
                     *[a for n in _ns for a in (S((n, 4096), jnp.int4),
                                                S((32, n), jnp.float16))]))
for _fmt in ("Q4_0", "Q6_K"):  # 128-code tiles, each group's codes sliced in registers
    KERNEL_CASES[f"{_fmt} mosaic wide 16x4096x14336"] = nk_case(
        _fmt, 16, 4096, (14336,), pk.MgpuMatmulConfig(gps=2, stages=4, splits=4, wide=True))


# Scales before the product (MgpuMatmulConfig.pre): each group's codes scaled in bf16, one
# accumulator a step, no x sums (one- and two-level scales, 6-bit codes, int4 in fragment order)
for _fmt, _m in (("Q4_K", 1), ("Q6_K", 1), ("Q8_0", 16)):
    KERNEL_CASES[f"{_fmt} mosaic pre {_m}x4096x14336"] = nk_case(
        _fmt, _m, 4096, (14336,), pk.MgpuMatmulConfig(gps=2, stages=4, splits=4, wide=True,
                                                      frag=_fmt == "Q4_K", pre=True))
KERNEL_CASES["Q4_K mosaic pre boundary 1x4096x14336+14336 4 deltas"] = nk_case(
    "Q4_K", 1, 4096, (14336, 14336), pk.MgpuMatmulConfig(
        gps=2, stages=3, splits=4, wide=True, frag=True, pre=True), deltas=4)


@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_lowers_for_h200(name):
    fn, args = KERNEL_CASES[name]
    module = lower_for_h200(fn, *args)
    assert "custom_call" in module  # a kernel, not an XLA fallback


def test_lowering_rejects_what_interpret_mode_accepts():
    """The check can fail: a Triton block of 24 rows runs in interpret mode but not on a GPU."""
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def call(x, interpret=False):
        return pl.pallas_call(copy, out_shape=S(x.shape, x.dtype), grid=(2,),
                              in_specs=[pl.BlockSpec((24,), lambda i: (i,))],
                              out_specs=pl.BlockSpec((24,), lambda i: (i,)),
                              interpret=interpret)(x)

    x = jnp.arange(48, dtype=F32)
    assert (call(x, interpret=True) == x).all()
    with pytest.raises(Exception, match="power of 2"):
        lower_for_h200(call, S((48,), F32))


# The model's ops take the Pallas kernels as on a GPU (the default backend here is the CPU).
ON_GPU = KernelPolicy(kernels=Kernels.PALLAS)


def decode_step_module(preset: str, batch: int, cache_len: int, policy=ON_GPU,
                       **overrides) -> str:
    """One decode step (T = 1) of `preset` with one layer (unless overridden) under policy."""
    config = PRESETS[preset].replace(**{"dtype": "bfloat16", "num_layers": 1, **overrides})
    params = abstract_params(llama.param_specs(config), BF16)
    cache = jax.eval_shape(lambda: KVCache.init(config, batch, cache_len))
    tokens = S((batch, 1), I32)
    plan = Plan(config, policy)

    def step(params, tokens, positions, cache):
        return llama.forward(params, tokens, positions, plan, cache)

    return lower_for_h200(step, params, tokens, tokens, cache)


def test_llama3_8b_batch1_decode_layer_kernels_default_and_deterministic():
    """Batch 1, one layer, in one process: the default policy's 4 kernels per decode layer
    (the boundaries ride in the q/k/v matmul and SwiGLU, the MLP is one swiglu_down, the
    attention sums q/k/v's chunks) plus the final add + norm, the LM head in XLA; the
    deterministic policy's 5 (SwiGLU, then down: no float atomics; the cache read as pages by
    the engine's paged chunk kernel, RoPE and the append in XLA) plus the final add + norm and
    the LM head as a fused matmul."""
    default = decode_step_module("llama3-8b", 1, 512)
    assert kernel_names(default) == collections.Counter({
        "norm_matmul_none_k4096_n6144_split2": 1, "decode_attention_append": 1,
        "matmul_none_k4096_n4096_split2": 1, "add_norm_matmul_swiglu_down_k4096_n14336": 1,
        "add_rms_norm": 1})
    deterministic = decode_step_module(
        "llama3-8b", 1, 512, KernelPolicy.deterministic(kernels=Kernels.PALLAS))
    assert kernel_names(deterministic) == collections.Counter({
        "norm_matmul_none_k4096_n6144_split2": 1, "paged_chunk_attention": 1,
        "matmul_none_k4096_n4096_split2": 1, "add_norm_matmul_swiglu_k4096_n14336": 1,
        "matmul_none_k14336_n4096_split2": 1, "add_rms_norm": 1,
        "matmul_none_k4096_n128256": 1})


def test_llama3_8b_batch1_decode_layer_boundaries_as_kernels():
    """The boundaries as add_rms_norm kernels: the seven kernels of a decode layer (the first
    norm, q/k/v chunks, attention summing them, o chunks, add + norm, SwiGLU, down chunks,
    add + norm) and no merge, q/k/v sum or residual kernel from XLA around them."""
    module = decode_step_module("llama3-8b", 1, 512, ON_GPU.replace(
        norm_linear_boundary=Boundary.KERNEL, gated_mlp_boundary=Boundary.KERNEL))
    assert kernel_names(module) == collections.Counter({
        "rms_norm": 1, "matmul_none_k4096_n6144_split2": 1, "decode_attention_append": 1,
        "matmul_none_k4096_n4096_split2": 1, "add_rms_norm": 2,
        "matmul_swiglu_k4096_n14336": 1, "matmul_none_k14336_n4096_split2": 1})
    assert module.count(TRITON) == 8  # the 7 of the layer + the first norm, one call each


def test_llama3_8b_batch64_long_context_decode_lowers():
    """B=64 takes XLA's GEMMs for the projections (M > 16), the SwiGLU and attention kernels."""
    names = kernel_names(decode_step_module("llama3-8b", 64, 2304))
    assert names["decode_attention_append"] == 1 and names["matmul_swiglu_k4096_n14336"] == 1
    assert not any(n.startswith("matmul_none") for n in names)  # the fused matmuls are M <= 16


def test_llama3_8b_deterministic_kernels_do_not_change_with_the_rows():
    """KernelPolicy.deterministic() at B = 64 and 256 (decode) and a 512-token prefill chunk
    against the cache: the same fused matmul kernels, at the same split, as at B = 1 (no
    XLA GEMM, the LM head included); the tiles are the same too (block_m 16: tests/
    test_batch_invariance.py runs them)."""
    det = KernelPolicy.deterministic(kernels=Kernels.PALLAS)
    matmuls = {"norm_matmul_none_k4096_n6144_split2": 1, "matmul_none_k4096_n4096_split2": 1,
               "add_norm_matmul_swiglu_k4096_n14336": 1, "matmul_none_k14336_n4096_split2": 1,
               "matmul_none_k4096_n128256": 1}
    for batch in (64, 256):
        names = kernel_names(decode_step_module("llama3-8b", batch, 1024, det))
        assert {n: names[n] for n in matmuls} == matmuls, names
        assert not any(n.startswith("matmul") and n not in matmuls for n in names), names
    config = PRESETS["llama3-8b"].replace(dtype="bfloat16", num_layers=1)
    params = abstract_params(llama.param_specs(config), BF16)
    cache = jax.eval_shape(lambda: KVCache.init(config, 1, 1024))
    plan = Plan(config, det)

    def chunk(params, tokens, cache):  # generate.prefill_chunk's forward: T = 512 at 512..
        positions = 512 + jnp.arange(512, dtype=I32)[None]
        return llama.forward(params, tokens, positions, plan, cache,
                             logits_at=jnp.full((1,), 511, I32))

    names = kernel_names(lower_for_h200(chunk, params, S((1, 512), I32), cache))
    assert {n: names[n] for n in matmuls} == matmuls, names


@pytest.mark.parametrize("preset", ["qwen3-8b", "smollm2-135m"])
def test_other_presets_decode_lowers(preset):
    """Qwen3 (q/k norm: the unfused attention path, which takes the q/k/v product finished)
    and SmolLM2 (head dim 64, tied embeddings): both boundaries ride in the consumer matmuls,
    add_rms_norm is the final norm's; the deterministic policy's tied LM head reads the
    embedding table [V, D] transposed."""
    names = kernel_names(decode_step_module(preset, 1, 512, num_layers=2))
    assert names["add_rms_norm"] == 1 and names["rms_norm"] == 0
    assert any(n.startswith("add_norm_matmul_swiglu") for n in names)
    assert any(n.startswith("add_norm_matmul_none") for n in names)  # layer 1's q/k/v
    assert names["decode_attention_append"] == (0 if preset == "qwen3-8b" else 1)
    det = kernel_names(decode_step_module(preset, 1, 512,
                                          KernelPolicy.deterministic(kernels=Kernels.PALLAS)))
    vocab = PRESETS[preset].vocab_size
    assert det[f"matmul_none_k{PRESETS[preset].hidden_size}_n{vocab}"] == 1, det


@pytest.mark.parametrize("how", ["int4", "int8", "fp8"])
def test_quantized_llama3_8b_decode_lowers(how):
    """The 8B decode step on quantized weights (two layers: q/k/v, o, SwiGLU, down and the LM
    head all on the fused kernels, codes read in the loop) through the Triton verifier."""
    from jaxinfer.weights import quantize_params

    config = PRESETS["llama3-8b"].replace(dtype="bfloat16", num_layers=2)
    params = jax.eval_shape(lambda: quantize_params(jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype), abstract_params(llama.param_specs(config), BF16)),
        how))
    cache = jax.eval_shape(lambda: KVCache.init(config, 1, 512))
    tokens = S((1, 1), I32)
    plan = Plan(config, ON_GPU)
    names = kernel_names(lower_for_h200(
        lambda p, t, c: llama.forward(p, t, t, plan, c), params, tokens, cache))
    quantized = {n for n in names if n.endswith(how)}
    assert any("swiglu" in n for n in quantized) and any("n128256" in n for n in quantized)
    assert len(quantized) >= 5, names


def test_gguf_block_layouts_lower_for_h200():
    """quantized_matmul and SwiGLU on the Q4_K / Q6_K / Q5_0 repacked layouts, Llama-3-8B's
    MLP shape, batch 1 and 16."""
    from pallas_kernels.quantized import QuantizedWeight, plane_rows

    k, n = 4096, 14336
    u8 = lambda rows: S((rows, n), jnp.uint8)  # noqa: E731
    f16 = S((k // 256, n), jnp.float16)
    layouts = {
        "q4_k": QuantizedWeight((u8(plane_rows(k, 32, 4)),), u8(k // 32), u8(k // 32), f16, f16,
                                k=k, out_shape=(n,), bits=(4,), group=32, super_group=256,
                                tile=32, name="q4_k"),
        "q6_k": QuantizedWeight((u8(plane_rows(k, 16, 4)), u8(plane_rows(k, 16, 2))),
                                S((k // 16, n), jnp.int8), None, f16, k=k, out_shape=(n,),
                                bits=(4, 2), group=16, super_group=256, tile=16, code_offset=32,
                                name="q6_k"),
        "q5_0": QuantizedWeight((u8(plane_rows(k, 32, 4)), u8(plane_rows(k, 32, 1))),
                                S((k // 32, n), jnp.float16), k=k, out_shape=(n,), bits=(4, 1),
                                group=32, tile=32, code_offset=16, name="q5_0"),
    }
    for name, qw in layouts.items():
        for m in (1, 16):
            x = S((m, k), BF16)
            assert name in str(kernel_names(lower_for_h200(pk.quantized_matmul, x, qw)))
            lower_for_h200(lambda x, w: pk.swiglu(x, w, w), x, qw)


def test_quantized_moe_experts_lower_for_h200():
    """Both experts kernels on stacked int4 (group 128) experts and on GGUF Q4_K gate / up with
    Q6_K down, at 1 and 32 tokens (E 8, k 2, D 1024, F 3584). jnp's `%` on the int4 plane's
    shift lowered to an i32 / i1 remainder inside the K loop (found on the H200)."""
    from pallas_kernels.quantized import QuantizedWeight, plane_rows

    e, d, f = 8, 1024, 3584

    def stack(*arrays):  # one expert's [rows, N] arrays -> [E, rows, N]
        return tuple(None if a is None else S((e, *a.shape), a.dtype) for a in arrays)

    def int4(k, n):
        planes, scale = stack(S((plane_rows(k, 128, 4), n), jnp.uint8), S((k // 128, n), BF16))
        return QuantizedWeight((planes,), scale, k=k, out_shape=(n,), bits=(4,), group=128,
                               tile=128, code_offset=8, name="int4")

    def q4_k(k, n):
        u8 = jnp.uint8
        planes, sc, mn, ss, so = stack(S((plane_rows(k, 32, 4), n), u8), S((k // 32, n), u8),
                                       S((k // 32, n), u8), S((k // 256, n), jnp.float16),
                                       S((k // 256, n), jnp.float16))
        return QuantizedWeight((planes,), sc, mn, ss, so, k=k, out_shape=(n,), bits=(4,),
                               group=32, super_group=256, tile=32, name="q4_k")

    def q6_k(k, n):
        lo, hi, sc, ss = stack(S((plane_rows(k, 16, 4), n), jnp.uint8),
                               S((plane_rows(k, 16, 2), n), jnp.uint8),
                               S((k // 16, n), jnp.int8), S((k // 256, n), jnp.float16))
        return QuantizedWeight((lo, hi), sc, None, ss, k=k, out_shape=(n,), bits=(4, 2),
                               group=16, super_group=256, tile=16, code_offset=32, name="q6_k")

    layouts = {"int4": (int4(d, f), int4(d, f), int4(f, d)),
               "gguf": (q4_k(d, f), q4_k(d, f), q6_k(f, d))}
    for name, (wg, wu, wd) in layouts.items():
        for n in (1, 32):
            args = (S((n, d), BF16), S((n, 2), F32), S((n, 2), I32), wg, wu, wd)
            for fn in (pk.moe_decode, pk.moe_grouped):
                assert "custom_call" in lower_for_h200(fn, *args), (name, n, fn.__name__)

def _prefetches(modules) -> collections.Counter:
    counts = collections.Counter()  # (kernel, prefetches in it), per distinct lowering
    for text in modules:
        name = re.search(r"tt\.func (?:public )?@(\w+)", text).group(1)
        asm = re.findall(r'"prefetch\.global\.L2::evict_last \[\$1\+0\];[^"]*"'
                         r"[^\n]*pure = false[^\n]*tensor<128x!tt\.ptr<bf16>>", text)
        counts[name, len(asm)] += 1
    return counts


def test_l2_prefetch_lowers_to_one_prefetch_per_thread(verify_triton_modules):
    """Every prefetch on (rows 128 at the start), two decode layers, the MLP as two kernels:
    o prefetches SwiGLU's two weights, SwiGLU down, down the next layer's q/k/v (the last
    layer's down nothing), each as a non-pure inline asm over one pointer per thread that
    nothing may remove."""
    every = Prefetch(128, At.START)
    decode_step_module("llama3-8b", 1, 512, ON_GPU.replace(
        one_kernel_mlp_rows=0, prefetch_norm_linear=every, prefetch_down=every,
        prefetch_gated_mlp=every), num_layers=2)
    assert _prefetches(verify_triton_modules) == collections.Counter([
        ("norm_matmul_none_k4096_n6144_split2", 0),  # layer 0's q/k/v
        ("add_norm_matmul_none_k4096_n6144_split2", 0),  # layer 1's (adds down's chunks)
        ("decode_attention_append", 0),
        ("matmul_none_k4096_n4096_split2", 2),  # o: gate and up (one lowering, both layers)
        ("add_norm_matmul_swiglu_k4096_n14336", 1),  # SwiGLU: down
        ("matmul_none_k14336_n4096_split2", 1),  # layer 0's down: layer 1's q/k/v
        ("matmul_none_k14336_n4096_split2", 0),  # the last layer's down: nothing
        ("add_rms_norm", 0)]), _prefetches(verify_triton_modules)


def test_one_kernel_mlp_prefetches(verify_triton_modules):
    """The default batch-1 MLP (swiglu_down), two layers: each program prefetches its first
    w_down tile (down_prefetch), and layer 0's also the next q/k/v's first rows
    (prefetch_norm_linear); the MLP adds o's chunks and runs the norm, q/k/v adds its float32
    accumulator."""
    decode_step_module("llama3-8b", 1, 512, num_layers=2)
    counts = _prefetches(verify_triton_modules)
    assert counts[("add_norm_matmul_swiglu_down_k4096_n14336", 2)] == 1, counts  # layer 0
    assert counts[("add_norm_matmul_swiglu_down_k4096_n14336", 1)] == 1, counts  # layer 1
    assert counts[("add_norm_matmul_none_k4096_n6144_split2", 0)] == 1, counts


@pytest.mark.parametrize("preset", ["gemma3-1b", "gemma3-27b"])
def test_gemma3_decode_lowers(preset):
    """A Gemma 3 decode step (6 layers: 5 sliding, 1 full) at batch 1 on the GPU path: the
    q/k/v, o and down projections on the fused small-M kernel, GeGLU in the SwiGLU kernel's
    epilogue, the attention (q/k norm: finished q/k/v) in the split-K decode kernel; the
    sandwich norms and the q/k norms stay in XLA (Gemma's (1 + w) in float32)."""
    from jaxinfer.models import gemma

    full = PRESETS[preset]
    config = full.replace(num_layers=6, layer_windows=full.layer_windows[:6])
    params = abstract_params(gemma.param_specs(config), BF16)
    cache = jax.eval_shape(lambda: KVCache.init(config, 1, 2048))
    tokens = S((1, 1), I32)
    plan = Plan(config, ON_GPU)

    def step(params, tokens, positions, cache):
        return gemma.forward(params, tokens, positions, plan, cache)

    names = kernel_names(lower_for_h200(step, params, tokens, tokens, cache))
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * hd
    # (kernel_names counts the distinct kernels: the sliding and the full layers' attention)
    assert names["decode_attention"] == 2, names
    assert names[f"matmul_swiglu_k{d}_n{f}"] == 1, names
    assert any(n.startswith(f"matmul_none_k{d}_n{qkv}") for n in names), names
    assert any(n.startswith(f"matmul_none_k{f}_n{d}") for n in names), names


@pytest.mark.parametrize("preset, batch", [("mixtral-8x7b", 1), ("qwen3-30b-a3b", 8)])
def test_moe_decode_step_takes_the_experts_kernels(preset, batch):
    """A MoE decode step on the GPU path (two layers): one row per token-expert assignment at
    batch 1 (Mixtral's moe_decode_rows is 1), the grouped GEMM at 8 rows of Qwen3-30B-A3B's
    (above its 4); either's weighted chunks added to the stream by the next layer's q/k/v
    kernel."""
    names = kernel_names(decode_step_module(preset, batch, 512, num_layers=2))
    kind = "decode" if batch == 1 else "grouped"
    assert any(n.startswith(f"moe_{kind}_swiglu") for n in names), names
    assert any(n.startswith(f"moe_{kind}_down") for n in names), names
    config = PRESETS[preset]
    qkv = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    assert any(n.startswith(f"add_norm_matmul_none_k{config.hidden_size}_n{qkv}")
               for n in names), names


def test_moe_tiles_and_router_come_from_the_policy():
    """KernelPolicy.moe_decode_blocks reaches the decode kernels (the down projection's split
    in its name); moe_route_rows puts the router in its kernels (16 blocks of D, then the
    pick; one lowering each for the two layers), with the sublayer's boundary."""
    blocks = pk.MoEBlockSizes(block_m=16, block_n=128, block_n_down=64, block_k=128,
                              split_k=4, num_warps=4)
    names = kernel_names(decode_step_module("mixtral-8x7b", 1, 512, ON_GPU.replace(
        moe_decode_blocks=blocks, moe_route_rows=1)))
    assert names["moe_decode_down_f14336_d4096_split4"] == 1, names
    # the attention's chunks, the residual add and the norm in the router's kernel
    assert names["add_rms_norm_route_blocks"] == 1 and names["moe_route_pick"] == 1, names
    assert not {"add_rms_norm_route", "moe_route", "moe_route_blocks"} & set(names), names
