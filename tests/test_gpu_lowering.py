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
from jax._src.pallas.triton import lowering as triton_lowering  # to verify its modules
from jax.sharding import AbstractDevice, AbstractMesh

import pallas_kernels as pk
from pallas_kernels.decode_matmul_mgpu import DecodeMatmulConfig, decode_matmul_mgpu
from jaxinfer.cache import KVCache
from jaxinfer.configs import PRESETS
from jaxinfer.models import layers, llama
from kernel_testing import set_boundaries

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


def decode_step_module(preset: str, batch: int, cache_len: int, **overrides) -> str:
    """One decode step (T = 1) of `preset` with one layer (unless overridden), the model's GPU
    dispatch on."""
    config = PRESETS[preset].replace(**{"dtype": "bfloat16", "num_layers": 1, **overrides})
    params = jax.tree.map(lambda s: S(s.shape, BF16), llama.param_specs(config),
                          is_leaf=lambda s: isinstance(s, layers.ParamSpec))
    cache = jax.eval_shape(lambda: KVCache.init(config, batch, cache_len))
    tokens = S((batch, 1), I32)

    def step(params, tokens, positions, cache):
        return llama.forward(params, tokens, positions, config, cache)

    return lower_for_h200(step, params, tokens, tokens, cache)


@pytest.fixture
def gpu_dispatch(monkeypatch):
    """The model's layers take the kernels as on a GPU (the default backend here is the CPU)."""
    monkeypatch.setattr(layers, "use_kernels",
                        lambda dtype: jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))


def test_llama3_8b_batch1_decode_layer_kernels(gpu_dispatch, monkeypatch):
    """B=1 at short context with the boundaries as kernels (layers.BOUNDARY_MODES["kernel"]):
    the seven kernels of a decode layer (the first norm, q/k/v chunks, attention summing them,
    o chunks, add + norm, SwiGLU, down chunks, add + norm) and no merge, q/k/v sum or residual
    kernel from XLA around them."""
    set_boundaries(monkeypatch, "kernel")
    module = decode_step_module("llama3-8b", 1, 512)
    assert kernel_names(module) == collections.Counter({
        "rms_norm": 1, "matmul_none_k4096_n6144_split2": 1, "decode_attention_append": 1,
        "matmul_none_k4096_n4096_split2": 1, "add_rms_norm": 2,
        "matmul_swiglu_k4096_n14336": 1, "matmul_none_k14336_n4096_split2": 1})
    assert module.count(TRITON) == 8  # the 7 of the layer + the first norm, one call each


@pytest.mark.parametrize("one_kernel_mlp", [True, False], ids=["mlp_1_kernel", "mlp_2_kernels"])
def test_llama3_8b_batch1_decode_layer_boundaries_in_consumers(gpu_dispatch, monkeypatch,
                                                               one_kernel_mlp):
    """The default, layers.BOUNDARY_MODES["consumers"]: 4 kernels per decode layer at batch 1
    (the boundaries ride in the q/k/v and SwiGLU matmuls, the MLP is one swiglu_down), 5 with
    ONE_KERNEL_MLP_ROWS = 0 (SwiGLU, then down); the last add + norm before the logits."""
    assert (layers.FUSED_ADD_NORM, layers.SWIGLU_ADD_NORM,
            layers.QKV_ADD_NORM) == layers.BOUNDARY_MODES["consumers"]
    assert layers.ONE_KERNEL_MLP_ROWS == 1
    if not one_kernel_mlp:
        monkeypatch.setattr(layers, "ONE_KERNEL_MLP_ROWS", 0)
    module = decode_step_module("llama3-8b", 1, 512)
    mlp = ({"add_norm_matmul_swiglu_down_k4096_n14336": 1} if one_kernel_mlp else
           {"add_norm_matmul_swiglu_k4096_n14336": 1, "matmul_none_k14336_n4096_split2": 1})
    assert kernel_names(module) == collections.Counter({
        "norm_matmul_none_k4096_n6144_split2": 1, "decode_attention_append": 1,
        "matmul_none_k4096_n4096_split2": 1, **mlp, "add_rms_norm": 1})


def test_llama3_8b_batch64_long_context_decode_lowers(gpu_dispatch):
    """B=64 takes XLA's GEMMs for the projections (M > 16), the SwiGLU and attention kernels."""
    names = kernel_names(decode_step_module("llama3-8b", 64, 2304))
    assert names["decode_attention_append"] == 1 and names["matmul_swiglu_k4096_n14336"] == 1
    assert not any(n.startswith("matmul_none") for n in names)  # the fused matmuls are M <= 16


@pytest.mark.parametrize("preset", ["qwen3-8b", "smollm2-135m"])
def test_other_presets_decode_lowers(gpu_dispatch, preset):
    """Qwen3 (q/k norm: the unfused attention path, whose boundary stays a norm kernel) and
    SmolLM2 (head dim 64, tied embeddings: the q/k/v matmul takes the norm); the MLP boundary
    rides in SwiGLU, add_rms_norm is the final norm's."""
    names = kernel_names(decode_step_module(preset, 1, 512))
    assert names["add_rms_norm"] == 1
    assert any(n.startswith("add_norm_matmul_swiglu") for n in names)
    assert names["rms_norm"] == (1 if preset == "qwen3-8b" else 0)


def test_decode_matmul_mgpu_lowers():
    """The Mosaic decode matmul (benchmarks/pdl_probe.py times it on the H200) lowers with and
    without the PDL instructions, and only the PDL one is marked for XLA's launch (interpret
    mode has no rule for those instructions)."""
    for pdl in (False, True):
        # 32 columns: the activation tile takes the weight tile's narrower swizzle (wgmma)
        for cfg in (DecodeMatmulConfig(64, 64, 4), DecodeMatmulConfig(128, 64, 6),
                    DecodeMatmulConfig(32, 128, 6)):
            module = lower_for_h200(
                lambda x, w: decode_matmul_mgpu(x, w, config=cfg, pdl=pdl),
                S((8, 4096), BF16), S((4096, 4096), BF16))
            assert module.count("custom_call @mosaic_gpu") == 1
            assert ("uses_pdl" in module) == pdl


def _pdl_copy(x, interpret=False):
    """A kernel that lets its successor launch, waits for its predecessor, then copies x."""
    from jax.experimental import pallas as pl

    from pallas_kernels.pdl import gdc_launch_dependents, gdc_wait, gdc_wait_token

    def kernel(x_ref, o_ref):
        gdc_launch_dependents()
        gdc_wait()
        o_ref[...] = x_ref[...] + gdc_wait_token().astype(x_ref.dtype)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interpret)(x)


def test_pdl_instructions_lower_to_the_grid_dependency_ops(verify_triton_modules):
    """pallas_kernels.pdl: the Triton ops XLA's pipeline turns into griddepcontrol, in the
    order written, and nothing at all in interpret mode (the copy is exact)."""
    x = jnp.arange(16 * 32, dtype=F32).reshape(16, 32)
    assert bool(jnp.all(_pdl_copy(x, interpret=True) == x))
    lower_for_h200(_pdl_copy, S((16, 32), F32))
    ops = re.findall(r"tt\.grid_dependency_\w+|griddepcontrol\.wait",
                     verify_triton_modules[-1])
    assert ops == ["tt.grid_dependency_launch_dependents", "tt.grid_dependency_wait",
                   "griddepcontrol.wait"]


def test_l2_prefetch_lowers_to_one_bulk_prefetch_per_thread(gpu_dispatch, monkeypatch,
                                                             verify_triton_modules):
    """layers.PREFETCH all on, two decode layers, the MLP as two kernels: q/k/v prefetches o,
    o prefetches SwiGLU's two weights, SwiGLU down, down the next layer's q/k/v (the last
    layer's down nothing), each as a non-pure inline asm over one pointer per thread that
    nothing may remove."""
    for consumer in ("o", "mlp", "down", "qkv"):
        monkeypatch.setitem(layers.PREFETCH, consumer, (128, "start"))
    monkeypatch.setattr(layers, "ONE_KERNEL_MLP_ROWS", 0)
    decode_step_module("llama3-8b", 1, 512, num_layers=2)
    counts = collections.Counter()  # (kernel, prefetches in it), per distinct lowering
    for text in verify_triton_modules:
        name = re.search(r"tt\.func (?:public )?@(\w+)", text).group(1)
        asm = re.findall(r'"prefetch\.global\.L2::evict_last \[\$1\+0\];[^"]*"'
                         r"[^\n]*pure = false[^\n]*tensor<128x!tt\.ptr<bf16>>", text)
        counts[name, len(asm)] += 1
    assert counts == collections.Counter([
        ("norm_matmul_none_k4096_n6144_split2", 1),  # layer 0's q/k/v: o's weight
        ("add_norm_matmul_none_k4096_n6144_split2", 1),  # layer 1's (adds down's chunks)
        ("decode_attention_append", 0),
        ("matmul_none_k4096_n4096_split2", 2),  # o: gate and up (one lowering, both layers)
        ("add_norm_matmul_swiglu_k4096_n14336", 1),  # SwiGLU: down
        ("matmul_none_k14336_n4096_split2", 1),  # layer 0's down: layer 1's q/k/v
        ("matmul_none_k14336_n4096_split2", 0),  # the last layer's down: nothing
        ("add_rms_norm", 0)]), counts


def test_one_kernel_mlp_prefetches(gpu_dispatch, verify_triton_modules):
    """The default batch-1 MLP (swiglu_down), two layers: each program prefetches its first
    w_down tile (down_prefetch), and layer 0's also the next q/k/v's first rows
    (PREFETCH["qkv"]); the MLP adds o's chunks and runs the norm, q/k/v adds its float32
    accumulator."""
    decode_step_module("llama3-8b", 1, 512, num_layers=2)
    counts = collections.Counter()
    for text in verify_triton_modules:
        name = re.search(r"tt\.func (?:public )?@(\w+)", text).group(1)
        asm = re.findall(r'"prefetch\.global\.L2::evict_last \[\$1\+0\];[^"]*"'
                         r"[^\n]*pure = false[^\n]*tensor<128x!tt\.ptr<bf16>>", text)
        counts[name, len(asm)] += 1
    assert counts[("add_norm_matmul_swiglu_down_k4096_n14336", 2)] == 1, counts  # layer 0
    assert counts[("add_norm_matmul_swiglu_down_k4096_n14336", 1)] == 1, counts  # layer 1
    assert counts[("add_norm_matmul_none_k4096_n6144_split2", 0)] == 1, counts


@pytest.mark.parametrize("insn,want", [("line", "prefetch.global.L2::evict_last [$1+0];"),
                                       ("bulk", "cp.async.bulk.prefetch.L2.global [$1],"),
                                       ("none", '" mov.u32 $0, 0;"')])
def test_l2_prefetch_instruction_choices(insn, want, monkeypatch, verify_triton_modules):
    """l2_prefetch.INSTRUCTION picks what the asm holds; "none" keeps the addresses and the asm
    but prefetches nothing (a probe); anything else is refused by name."""
    import importlib

    l2p = importlib.import_module("pallas_kernels.l2_prefetch")
    from pallas_kernels.norm_matmul import first_rows_plan

    def fn(x, w, nxt):
        return pk.norm_matmul(x, None, w, partials=True,
                              prefetch=((nxt, first_rows_plan(1, 4096, 4096)),))

    args = (S((1, 4096), BF16), S((4096, 4096), BF16), S((4096, 4096), BF16))
    monkeypatch.setattr(l2p, "INSTRUCTION", insn)
    jax.clear_caches()  # the setting is read at lowering; a cached lowering would hide it
    lower_for_h200(fn, *args)
    assert want in verify_triton_modules[-1]
    monkeypatch.setattr(l2p, "INSTRUCTION", "l1")
    jax.clear_caches()
    with pytest.raises(ValueError, match="INSTRUCTION='l1'"):
        lower_for_h200(fn, *args)
    jax.clear_caches()  # no lowering made with this test's setting outlives it
