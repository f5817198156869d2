"""Weight-streaming decode matmul for Hopper on the Pallas Mosaic GPU backend (experimental).

    decode_matmul_mgpu(x, w, config=, pdl=)   x [Mp, K] @ w [K, N] -> [Mp, N] in x's dtype

Not used by the model: the decode matmuls are `norm_matmul` (Pallas Triton). This kernel exists
to measure programmatic dependent launch (benchmarks/pdl_probe.py), and it measured that XLA
(jax 0.11.2) does not overlap consecutive Mosaic kernels even when they carry the PDL
instructions (benchmarks/NOTES.md, "What should close the rest of the gap"); it is also slower
than the Triton kernel at batch 1 (14.1 vs 12.6 us for a 4096 x 4096 weight on the H200). It is
kept, tested, as the starting point for when a launch path honours PDL.

Why it exists: a batch-1 decode step is a chain of kernels that each stream a weight and read a
small activation the previous kernel wrote. Every kernel pays a ramp (its first loads) and a
tail (its last programs) of ~2.5 us (benchmarks/NOTES.md, Run D) that block sizes cannot hide.
Programmatic dependent launch (PDL) can: a kernel started early on the SMs its predecessor
frees issues its weight loads (which do not depend on the predecessor) and only then waits
(`griddepcontrol.wait`) for the predecessor's output. Pallas Triton cannot emit those
instructions; Mosaic GPU can (`plgpu.griddepcontrol_wait` / `launch_dependents`).

One program owns a [Mp, block_n] slab of the output and walks K in `block_k` steps: the weight
tile [block_k, block_n] and the activation tile [Mp, block_k] come in with TMA into a ring of
`stages` shared-memory slots; wgmma multiplies them (M is the tensor core's minimum of 64: the
activation tile sits in the first Mp rows of a [64, block_k] slot, the other rows are never
read back). With `pdl`, the first `stages` weight tiles are issued before the wait and the
activation tiles after it.

Mp (rows of x) must be a multiple of 8 and <= 64: callers with fewer rows pad (rows are
independent; padded rows give padded outputs). K must be a multiple of block_k and N of block_n.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import ref_precision

WGMMA_M = 64  # rows of one wgmma (per warpgroup)


@dataclasses.dataclass(frozen=True)
class DecodeMatmulConfig:
    """block_n: output columns per program; block_k: K per pipeline step (64 = one 128-byte
    swizzled row of bf16); stages: ring depth (weight bytes in flight per program =
    stages * block_k * block_n * 2)."""
    block_n: int = 64
    block_k: int = 64
    stages: int = 4

    def __post_init__(self):
        if self.block_n % 8 or not 8 <= self.block_n <= 256:
            raise ValueError(f"DecodeMatmulConfig.block_n={self.block_n}: a multiple of 8 in "
                             f"[8, 256]")
        if self.block_k % 64:
            raise ValueError(f"DecodeMatmulConfig.block_k={self.block_k}: a multiple of 64")
        if self.stages < 1:
            raise ValueError(f"DecodeMatmulConfig.stages={self.stages}: must be >= 1")


def _transforms(cols: int, dtype):
    """Shared-memory tiling + swizzle for a tile whose minor dimension is `cols` wide."""
    swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def scratch_types(cfg: DecodeMatmulConfig, dtype) -> list:
    """The kernel's SMEM: x_smem [stages, 64, block_k], w_smem [stages, block_k, block_n],
    o_smem [64, block_n], x_ready / w_ready [stages] (also benchmarks/persistent_mgpu_probe's)."""
    return [
        # wgmma takes both operands under one swizzle: the narrower tile's
        plgpu.SMEM((cfg.stages, WGMMA_M, cfg.block_k), dtype,
                   transforms=_transforms(min(cfg.block_k, cfg.block_n), dtype)),
        plgpu.SMEM((cfg.stages, cfg.block_k, cfg.block_n), dtype,
                   transforms=_transforms(cfg.block_n, dtype)),
        plgpu.SMEM((WGMMA_M, cfg.block_n), dtype, transforms=_transforms(cfg.block_n, dtype)),
        plgpu.Barrier(num_barriers=cfg.stages),  # x_ready
        plgpu.Barrier(num_barriers=cfg.stages),  # w_ready
    ]


def _kernel(x_ref, w_ref, y_ref, x_smem, w_smem, o_smem, x_ready, w_ready, *,
            cfg: DecodeMatmulConfig, pdl: bool):
    # x_ref [Mp, K], w_ref [K, N], y_ref [Mp, N] (GMEM)
    # x_smem [stages, 64, block_k] (rows >= Mp unused), w_smem [stages, block_k, block_n],
    # o_smem [64, block_n]
    mp, k = x_ref.shape
    bn, bk, stages = cfg.block_n, cfg.block_k, cfg.stages
    nk = k // bk
    n0 = lax.axis_index("n") * bn

    def issue_w(j, slot):
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(j * bk, bk), pl.ds(n0, bn)], w_smem.at[slot],
                                w_ready.at[slot])

    def issue_x(j, slot):
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(j * bk, bk)], x_smem.at[slot, pl.ds(0, mp)],
                                x_ready.at[slot])

    first = min(stages, nk)
    for j in range(first):  # the weight stream does not depend on the previous kernel
        issue_w(j, j)
    if pdl:
        # All programs of this kernel have started: the next kernel may be scheduled.
        plgpu.griddepcontrol_launch_dependents()
        if pdl != "nowait":  # "nowait": a timing probe only (races with the previous kernel)
            # x is the previous kernel's output: wait for that kernel (and its memory) first.
            plgpu.griddepcontrol_wait()
    for j in range(first):
        issue_x(j, j)

    def body(acc_ref):
        def step(j, carry):
            slot = lax.rem(j, stages)
            plgpu.barrier_wait(w_ready.at[slot])
            plgpu.barrier_wait(x_ready.at[slot])
            plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot])
            # Keep this step's product in flight; the previous one is done, so its slot
            # takes the tile `stages` steps after it.
            plgpu.wgmma_wait(1)
            prev = j - 1

            @pl.when((prev >= 0) & (prev + stages < nk))
            def _refill():
                prev_slot = lax.rem(prev + stages, stages)
                issue_w(prev + stages, prev_slot)
                issue_x(prev + stages, prev_slot)
            return carry

        lax.fori_loop(0, nk, step, None)
        plgpu.wgmma_wait(0)
        o_smem[...] = acc_ref[...].astype(o_smem.dtype)

    pl.run_scoped(body, plgpu.ACC((WGMMA_M, bn), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, mp)], y_ref.at[:, pl.ds(n0, bn)])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("cfg", "pdl", "interpret"))
def _decode_matmul_mgpu(x, w, *, cfg: DecodeMatmulConfig, pdl, interpret: bool):
    mp, k = x.shape
    n = w.shape[1]
    dtype = x.dtype
    return plgpu.kernel(
        # The interpreter has no grid dependency control (and needs none: it runs in order).
        functools.partial(_kernel, cfg=cfg, pdl=pdl and not interpret),
        out_type=jax.ShapeDtypeStruct((mp, n), dtype),
        scratch_types=scratch_types(cfg, dtype),
        grid=(n // cfg.block_n,),
        grid_names=("n",),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(x, w)


def decode_matmul_mgpu(x, w, *, config: DecodeMatmulConfig | None = None,
                       pdl: bool | str = False, interpret: bool = False):
    """x [Mp, K] @ w [K, N] -> [Mp, N] (x's dtype, float32 accumulation); see the module.
    pdl=True: programmatic dependent launch (weights streamed before waiting for x's writer);
    pdl="nowait": the same without the wait, for timing probes only (x may be read early)."""
    cfg = config or DecodeMatmulConfig()
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"decode_matmul_mgpu: x {x.shape} @ w {w.shape}: want [Mp, K] @ [K, N]")
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16),
                                                        jnp.dtype(jnp.float16)):
        raise ValueError(f"decode_matmul_mgpu: dtypes {x.dtype}, {w.dtype}: both bfloat16 or "
                         f"both float16")
    mp, k = x.shape
    n = w.shape[1]
    if mp % 8 or mp > WGMMA_M:
        raise ValueError(f"decode_matmul_mgpu: {mp} rows: pad x to a multiple of 8 <= 64")
    if k % cfg.block_k or n % cfg.block_n:
        raise ValueError(f"decode_matmul_mgpu: K={k}, N={n} must be multiples of block_k="
                         f"{cfg.block_k}, block_n={cfg.block_n}")
    return _decode_matmul_mgpu(x, w, cfg=cfg, pdl=pdl, interpret=interpret)


def decode_matmul_reference(x, w):
    """The plain product, float32 accumulation, rounded to x's dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32,
                   precision=ref_precision(x.dtype)).astype(x.dtype)
