"""A persistent Mosaic GPU kernel for a chain of batch-1 products: is a grid barrier with the
weight stream running *through* it cheaper than a kernel boundary?

    PYTHONPATH=. python3 benchmarks/persistent_mgpu_probe.py [--dim 4096] [--layers 16] [--json F]

Why: the batch-1 decode step is a chain of weight-streaming kernels, and each loses ~2.5 us of
ramp and tail (benchmarks/NOTES.md, runs D-L). Two ways to hide that were measured and lost:
- PDL: XLA (jax 0.11.2) launches Pallas kernels without it (run J);
- a persistent Pallas *Triton* kernel with a counter barrier (grid_barrier_probe.py, session 5):
  the barrier cost more than a launch, and weight tiles loaded before it sat in registers,
  outside Triton's pipeline, and made it worse.
Mosaic GPU differs on the second point: the weight tiles come in with TMA into a ring of
shared-memory slots that the kernel manages itself, so the ring can simply run on across the
phase boundary. While a program waits at the barrier for the other programs' outputs, its
next weight tiles are already landing. Only the activation tiles (the previous phase's output,
8 KB) wait for the barrier.

The workload: `--layers` products y = x @ w_l, x [8, D] (row 0 real), w_l [D, D] bf16, one
buffer per layer (as the model's), y the x of the next; timed in one executable repeated
`--repeats` times:
  - xla: jnp.dot per product;
  - norm_matmul: the model's decode matmul per product (Pallas Triton, x [1, D]; split-K, so
    an XLA sum per product, which the model's consumers absorb instead);
  - mosaic kernels BODY: decode_matmul_mgpu per product (one Mosaic kernel each);
  - persistent BODY: one Mosaic kernel for the chain, x as wgmma's A operand (padded to 64
    rows in SMEM), a grid barrier between phases, the ring drained at each phase's end;
  - persistent BODY +ring: the same, the ring running across the barriers;
  - wa BODYxSPLIT[w]: the transposed form (y^T = W^T x^T: the weight tile is A, the 8
    activation rows are B, no padding), the ring running across the barriers; SPLIT K parts
    per column tile (the next phase multiplies every part); "w": each phase's x loaded whole;
  - ... nobarrier: no barrier at all (wrong by design: the barrier's cost, the streaming bound).
BODY = block_n x block_k x stages. Every variant is checked against jnp (row 0).
`--stream 'KxN:BODYxSPLITxPROGRAMS+...;...'` times single products instead (kernel time from a
profiler trace): XLA, norm_matmul and `stream_wa`, the transposed form with work units dealt
to a fixed number of programs, for the steady streaming rate at the model's shapes.

Results (H200, jax 0.11.2; benchmarks/NOTES.md, run M): the barrier works, and with the ring
running through it costs 0.3-1.2 us; the transposed form streams as fast as XLA and the
production kernels (4.1 TB/s at 117 MB); but the best persistent chain, 10.8-11.2 us per
4096 x 4096 product, is no faster than the production kernels inside the model's step (o:
10.2 us of kernel time), because what a phase waits for after the barrier (its activation
from L2) costs about what a kernel boundary costs.

The barrier: one global semaphore (zeroed before each call by Pallas). After its output's TMA
store has completed, a program fences the async proxy and adds 1 (release, gpu scope); before
phase l it waits (acquire) for the count to reach programs * l, then fences the async proxy so
that its TMA loads see the other programs' outputs. All programs must be resident at once:
D / block_n <= the SM count, one program per SM (the ring's shared memory sees to that).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_kernels as pk
from benchmarks.chain_timing import finish, measure_all
from pallas_kernels.decode_matmul_mgpu import (WGMMA_M, DecodeMatmulConfig, decode_matmul_mgpu,
                                               scratch_types)

MP = 8  # activation rows (row 0 real), the smallest TMA-friendly multiple of 8


@plgpu.inline_mgpu()
def _fence_proxy_async(ctx):
    """Orders this thread's generic-proxy accesses with its async-proxy (TMA) ones."""
    del ctx
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    mgpu_utils.inline_ptx("fence.proxy.async.global;", has_side_effects=True)


def _walk_ring(*, nk: int, base: int, stages: int, mma, refill_this, refill_next=None):
    """The nk steps of one phase (or unit) over a ring of `stages` SMEM slots: step j is global
    step base + j and sits in slot (base + j) % stages. mma(j, slot) waits for step j's tiles
    and issues its wgmma(s); one stays in flight, so when step j's is issued, step j - 1's slot
    is free and takes this phase's step j - 1 + stages (refill_this(step, slot)) or, past the
    phase's end, the next phase's weight tile (refill_next(step of the next phase, slot): the
    ring running on; None: drained). The last step's slot is refilled after the loop."""
    def step(j, carry):
        mma(j, lax.rem(base + j, stages))
        plgpu.wgmma_wait(1)  # step j - 1's product is done: its slot is free

        @pl.when(j >= 1)
        def _refill():
            jn = j - 1 + stages  # the step whose tiles go into the freed slot
            free = lax.rem(base + j - 1, stages)

            @pl.when(jn < nk)
            def _this_phase():
                refill_this(jn, free)

            if refill_next is not None:
                @pl.when(jn >= nk)
                def _next_phase():  # its weights do not depend on this phase
                    refill_next(jn - nk, free)
        return carry

    lax.fori_loop(0, nk, step, None)
    plgpu.wgmma_wait(0)
    if refill_next is not None:
        refill_next(stages - 1, (base + nk - 1) % stages)


def _persistent_kernel(x_ref, *refs, cfg: DecodeMatmulConfig, layers: int, ring: bool,
                       barrier: bool):
    # x_ref [MP, D]; refs: L weights [D, D], y_ref [L, MP, D] (phase l's output, the x of
    # phase l + 1), then the scratch: x_smem [stages, 64, block_k] (rows >= MP unused),
    # w_smem [stages, block_k, block_n], o_smem [64, block_n], x_ready / w_ready [stages]
    w_refs = refs[:layers]
    y_ref, x_smem, w_smem, o_smem, x_ready, w_ready = refs[layers:]
    mp, d = x_ref.shape
    bn, bk, stages = cfg.block_n, cfg.block_k, cfg.stages
    nk = d // bk
    programs = d // bn
    n0 = pl.multiple_of(lax.axis_index("n") * bn, bn)
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

    def issue_w(layer, j, slot):
        plgpu.copy_gmem_to_smem(w_refs[layer].at[pl.ds(j * bk, bk), pl.ds(n0, bn)],
                                w_smem.at[slot], w_ready.at[slot])

    def issue_x(layer, j, slot):
        src = x_ref.at[:, pl.ds(j * bk, bk)] if layer == 0 else \
            y_ref.at[layer - 1, :, pl.ds(j * bk, bk)]
        plgpu.copy_gmem_to_smem(src, x_smem.at[slot, pl.ds(0, mp)], x_ready.at[slot])

    first = min(stages, nk)
    for layer in range(layers):
        base = layer * nk  # global step of this phase's step 0; slot = global step % stages
        if layer > 0 and barrier:
            plgpu.semaphore_wait(sem, programs * layer, decrement=False, memory_scope="gpu")
            _fence_proxy_async()
        if layer == 0 or not ring:
            for j in range(first):
                issue_w(layer, j, (base + j) % stages)
        for j in range(first):
            issue_x(layer, j, (base + j) % stages)

        def body(acc_ref, layer=layer, base=base):
            def mma(j, slot):
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot])

            def refill_this(j, slot, layer=layer):
                issue_w(layer, j, slot)
                issue_x(layer, j, slot)

            _walk_ring(nk=nk, base=base, stages=stages, mma=mma, refill_this=refill_this,
                       refill_next=functools.partial(issue_w, layer + 1)
                       if ring and layer + 1 < layers else None)
            o_smem[...] = acc_ref[...].astype(o_smem.dtype)

        pl.run_scoped(body, plgpu.ACC((WGMMA_M, bn), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, mp)], y_ref.at[layer, :, pl.ds(n0, bn)])
        plgpu.wait_smem_to_gmem(0)
        if layer + 1 < layers and barrier:
            _fence_proxy_async()  # the TMA store's writes before the release below
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")


R = 8  # activation rows in the transposed form ("wa"): the wgmma's N (row 0 real)


def _tile_transforms(rows_bytes: int):
    """Tiling + swizzle for an SMEM tile whose minor dimension is `rows_bytes` bytes (bf16)."""
    swizzle = plgpu.find_swizzle(rows_bytes * 8)
    return (plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle))


def _wa_scratch(cfg: DecodeMatmulConfig, dtype, x_shape: tuple[int, ...], x_barriers: int):
    """SMEM of the transposed form: activation tiles (x_shape, R x block_k tiles), the weight
    ring [stages, block_k, block_n], the output tile [R, block_n], the ready barriers."""
    return [
        plgpu.SMEM(x_shape, dtype, transforms=_tile_transforms(cfg.block_k * 2)),
        plgpu.SMEM((cfg.stages, cfg.block_k, cfg.block_n), dtype,
                   transforms=_tile_transforms(cfg.block_n * 2)),
        plgpu.SMEM((R, cfg.block_n), dtype, transforms=_tile_transforms(cfg.block_n * 2)),
        plgpu.Barrier(num_barriers=x_barriers),  # x_ready
        plgpu.Barrier(num_barriers=cfg.stages),  # w_ready
    ]


def _persistent_wa_kernel(x_ref, *refs, cfg: DecodeMatmulConfig, layers: int, split: int,
                          barrier: bool, whole_x: bool):
    # The transposed form: y^T = W^T x^T. The weight tile is wgmma's A operand (read
    # transposed from SMEM, M = block_n output columns) and the activation tile is B (read
    # transposed, N = R rows), both under a 128-byte swizzle; so no activation tile is padded
    # to 64 rows: a stage is block_k x block_n of weight + R x block_k of x per part.
    # Activations come in `split` parts that sum to them: act [split, R, D]. Program (n, h)
    # owns columns [n * block_n, +block_n) over K range h of `split` and writes its partial
    # sum as part h of the next activation; the next phase multiplies every part by its
    # weight tile (one wgmma each), which sums them.
    # x_ref [split, R, D] (part 0 = x, the others 0); refs: L weights [D, D],
    # y_ref [L, split, R, D], x_smem [split, stages, R, block_k], w_smem [stages, block_k,
    # block_n], o_smem [R, block_n] (the y^T tile stored transposed), x_ready
    # [split * stages], w_ready [stages]. whole_x: x_smem [split, R, K / split] instead, this
    # program's K range of every part loaded once per phase (one barrier per part), so a step
    # waits for its weight tile only.
    w_refs = refs[:layers]
    y_ref, x_smem, w_smem, o_smem, x_ready, w_ready = refs[layers:]
    d = x_ref.shape[2]
    bn, bk, stages = cfg.block_n, cfg.block_k, cfg.stages
    kh = d // split  # K rows per program
    nk = kh // bk
    programs = (d // bn) * split
    n0 = pl.multiple_of(lax.axis_index("n") * bn, bn)
    k_base = pl.multiple_of(lax.axis_index("h") * kh, bk)
    sem = pl.get_global(plgpu.SemaphoreType.REGULAR)

    def issue_w(layer, j, slot):
        plgpu.copy_gmem_to_smem(w_refs[layer].at[pl.ds(k_base + j * bk, bk), pl.ds(n0, bn)],
                                w_smem.at[slot], w_ready.at[slot])

    def issue_x(layer, j, slot):
        if whole_x:
            return
        for part in range(split):
            rows = pl.ds(k_base + j * bk, bk)
            src = x_ref.at[part, :, rows] if layer == 0 else y_ref.at[layer - 1, part, :, rows]
            plgpu.copy_gmem_to_smem(src, x_smem.at[part, slot],
                                    x_ready.at[part * stages + slot])

    first = min(stages, nk)
    for layer in range(layers):
        base = layer * nk
        if layer > 0 and barrier:
            plgpu.semaphore_wait(sem, programs * layer, decrement=False, memory_scope="gpu")
            _fence_proxy_async()
        if layer == 0:
            for j in range(first):
                issue_w(layer, j, (base + j) % stages)
        for j in range(first):
            issue_x(layer, j, (base + j) % stages)
        if whole_x:
            for part in range(split):
                rows = pl.ds(k_base, kh)
                src = x_ref.at[part, :, rows] if layer == 0 else y_ref.at[layer - 1, part, :, rows]
                plgpu.copy_gmem_to_smem(src, x_smem.at[part], x_ready.at[part])
            for part in range(split):
                plgpu.barrier_wait(x_ready.at[part])

        def body(acc_ref, layer=layer, base=base):
            def mma(j, slot):
                plgpu.barrier_wait(w_ready.at[slot])
                w_t = w_smem.at[slot].transpose((1, 0))  # [block_n, block_k]
                for part in range(split):
                    if whole_x:
                        xt = x_smem.at[part, :, pl.ds(pl.multiple_of(j * bk, bk), bk)]
                    else:
                        plgpu.barrier_wait(x_ready.at[part * stages + slot])
                        xt = x_smem.at[part, slot]
                    plgpu.wgmma(acc_ref, w_t, xt.transpose((1, 0)))

            def refill_this(j, slot, layer=layer):
                issue_w(layer, j, slot)
                issue_x(layer, j, slot)

            _walk_ring(nk=nk, base=base, stages=stages, mma=mma, refill_this=refill_this,
                       refill_next=functools.partial(issue_w, layer + 1)
                       if layer + 1 < layers else None)
            o_smem.transpose((1, 0))[...] = acc_ref[...].astype(o_smem.dtype)  # y^T tile

        pl.run_scoped(body, plgpu.ACC((bn, R), jnp.float32))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, y_ref.at[layer, lax.axis_index("h"), :, pl.ds(n0, bn)])
        plgpu.wait_smem_to_gmem(0)
        if layer + 1 < layers and barrier:
            _fence_proxy_async()
            plgpu.semaphore_signal(sem, 1, memory_scope="gpu")


def chain_persistent_wa(x, weights, *, cfg: DecodeMatmulConfig, split: int, barrier: bool = True,
                        whole_x: bool = False):
    """x [MP, D], weights: L arrays [D, D] -> [MP, D]: the transposed form (see
    _persistent_wa_kernel)."""
    layers, d = len(weights), x.shape[1]
    dtype = x.dtype
    xt = jnp.zeros((split, R, d), dtype).at[0, :MP].set(x)
    y = plgpu.kernel(
        functools.partial(_persistent_wa_kernel, cfg=cfg, layers=layers, split=split,
                          barrier=barrier, whole_x=whole_x),
        out_type=jax.ShapeDtypeStruct((layers, split, R, d), dtype),
        scratch_types=_wa_scratch(
            cfg, dtype,
            (split, R, d // split) if whole_x else (split, cfg.stages, R, cfg.block_k),
            split * cfg.stages),
        grid=(d // cfg.block_n, split),
        grid_names=("n", "h"),
    )(xt, *weights)
    # the last activation's parts summed in float32, rounded once (the next phase would
    # multiply them one by one); back to rows
    return y[-1].astype(jnp.float32).sum(0).astype(dtype)[:MP]  # [MP, D]


def _stream_wa_kernel(x_ref, w_ref, y_ref, x_smem, w_smem, o_smem, x_ready, w_ready, *,
                      cfg: DecodeMatmulConfig, split: int, units: int):
    # One product in the transposed form, for the steady streaming rate: the work units
    # (column tile n, K part h) are dealt round-robin to the programs, `units` each, and the
    # weight ring runs on from one unit into the next (no barrier: x is the same for all).
    # x_ref [R, K]; w_ref [K, N]; y_ref [split, R, N] (part h = K part h's partial sums);
    # x_smem [stages, R, block_k], w_smem [stages, block_k, block_n], o_smem [R, block_n]
    k, n = w_ref.shape
    bn, bk, stages = cfg.block_n, cfg.block_k, cfg.stages
    kh = k // split
    nk = kh // bk
    programs = lax.axis_size("p")
    me = lax.axis_index("p")

    def unit_at(u):  # -> (first column, first K row) of this program's u-th unit
        flat = me + u * programs
        return (pl.multiple_of((flat // split) * bn, bn),
                pl.multiple_of(lax.rem(flat, split) * kh, bk))

    def issue_w(u, j, slot):
        n0, k0 = unit_at(u)
        plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(k0 + j * bk, bk), pl.ds(n0, bn)],
                                w_smem.at[slot], w_ready.at[slot])

    def issue_x(u, j, slot):
        _, k0 = unit_at(u)
        plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0 + j * bk, bk)], x_smem.at[slot],
                                x_ready.at[slot])

    first = min(stages, nk)
    for j in range(first):
        issue_w(0, j, j)
    for u in range(units):
        base = u * nk
        for j in range(first):
            issue_x(u, j, (base + j) % stages)

        def body(acc_ref, u=u, base=base):
            def mma(j, slot):
                plgpu.barrier_wait(w_ready.at[slot])
                plgpu.barrier_wait(x_ready.at[slot])
                plgpu.wgmma(acc_ref, w_smem.at[slot].transpose((1, 0)),
                            x_smem.at[slot].transpose((1, 0)))

            def refill_this(j, slot, u=u):
                issue_w(u, j, slot)
                issue_x(u, j, slot)

            _walk_ring(nk=nk, base=base, stages=stages, mma=mma, refill_this=refill_this,
                       refill_next=functools.partial(issue_w, u + 1) if u + 1 < units else None)
            o_smem.transpose((1, 0))[...] = acc_ref[...].astype(o_smem.dtype)

        pl.run_scoped(body, plgpu.ACC((bn, R), jnp.float32))
        plgpu.commit_smem()
        n0, k0 = unit_at(u)
        plgpu.copy_smem_to_gmem(o_smem, y_ref.at[lax.div(k0, kh), :, pl.ds(n0, bn)])
        plgpu.wait_smem_to_gmem(0)


def stream_wa(x, w, *, cfg: DecodeMatmulConfig, split: int, programs: int,
              interpret: bool = False):
    """x [MP, K] @ w [K, N] -> [MP, N] by _stream_wa_kernel on `programs` programs (the K
    parts' partial sums added by XLA, as the production split-K path does for its chunks)."""
    (k, n), dtype = w.shape, x.dtype
    tiles = (n // cfg.block_n) * split
    if n % cfg.block_n or k % (split * cfg.block_k) or tiles % programs:
        raise ValueError(f"stream_wa: w {w.shape}: N must be a multiple of block_n="
                         f"{cfg.block_n}, K of split * block_k={split * cfg.block_k}, and the "
                         f"{tiles} work units a multiple of programs={programs}")
    units = tiles // programs
    xr = jnp.zeros((R, k), dtype).at[:MP].set(x)
    y = plgpu.kernel(
        functools.partial(_stream_wa_kernel, cfg=cfg, split=split, units=units),
        out_type=jax.ShapeDtypeStruct((split, R, n), dtype),
        scratch_types=_wa_scratch(cfg, dtype, (cfg.stages, R, cfg.block_k), cfg.stages),
        grid=(programs,),
        grid_names=("p",),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(xr, w)
    return y.astype(jnp.float32).sum(0).astype(dtype)[:MP]


def chain_persistent(x, weights, *, cfg: DecodeMatmulConfig, ring: bool, barrier: bool = True):
    """x [MP, D], weights: L arrays [D, D] -> the last phase's output [MP, D]."""
    layers, (mp, d) = len(weights), x.shape
    dtype = x.dtype
    y = plgpu.kernel(
        functools.partial(_persistent_kernel, cfg=cfg, layers=layers, ring=ring,
                          barrier=barrier),
        out_type=jax.ShapeDtypeStruct((layers, mp, d), dtype),
        scratch_types=scratch_types(cfg, dtype),  # decode_matmul_mgpu's
        grid=(d // cfg.block_n,),
        grid_names=("n",),
    )(x, *weights)
    return y[-1]


def chain_mosaic_kernels(x, weights, *, cfg: DecodeMatmulConfig):
    for w in weights:
        x = decode_matmul_mgpu(x, w, config=cfg)
    return x


def chain_norm_matmul(x, weights):
    """The model's decode matmul per layer on row 0 (its default blocks), rows padded back."""
    row = x[:1]
    for w in weights:
        row = pk.norm_matmul(row, None, w)
    return jnp.pad(row, ((0, x.shape[0] - 1), (0, 0)))


def chain_reference(x, weights):
    for w in weights:
        x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x


def time_products(shape: str, bodies: list[str], calls: int = 10) -> tuple[list, int]:
    """One product x [MP, K] @ w [K, N] (shape "KxN") by XLA, the production norm_matmul and
    stream_wa per body ("block_n x block_k x stages x split x programs"), each traced on its
    own: kernel time per call (all kernels: "total"; the largest one: "main", the weight
    stream without the sums of split parts or x's padding), TB/s of the weight on "main",
    error against jnp."""
    import collections
    import tempfile

    from benchmarks.profile_decode import device_kernels, load_trace

    k, n = (int(v) for v in shape.split("x"))
    keys = jax.random.split(jax.random.key(1), 2)
    x = jnp.zeros((MP, k), jnp.bfloat16).at[0].set(
        jax.random.normal(keys[0], (k,), jnp.float32).astype(jnp.bfloat16))
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    want = jnp.dot(x, w, preferred_element_type=jnp.float32)[:1]
    # copies of w in turn, so that no call finds its weight in L2 from the call before
    copies = [w] + [jnp.copy(w) for _ in range(3)]
    variants = {
        "xla": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
        "norm_matmul (production)": lambda x, w: pk.norm_matmul(x[:1], None, w),
    }
    for body in bodies:
        bn, bk, st, split, programs = (int(v) for v in body.split("x"))
        variants[f"stream {body}"] = functools.partial(
            stream_wa, cfg=DecodeMatmulConfig(block_n=bn, block_k=bk, stages=st), split=split,
            programs=programs)
    rows, failures = [], 0
    for name, fn in variants.items():
        try:
            run = jax.jit(fn)
            got = run(x, w)[:1].astype(jnp.float32)
            err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
            jax.block_until_ready(run(x, w))
            log_dir = tempfile.mkdtemp(prefix="stream_trace_")
            with jax.profiler.trace(log_dir):
                for i in range(calls):
                    jax.block_until_ready(run(x, copies[i % len(copies)]))
            by_name = collections.Counter()
            for e in device_kernels(load_trace(log_dir)):
                by_name[e["name"]] += float(e["dur"])
        except Exception as e:  # one failing variant does not hide the others
            print(f"{shape} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            failures += 1
            continue
        total = sum(by_name.values()) / calls
        main_us = max(by_name.values()) / calls
        row = dict(shape=shape, variant=name, us_total=total, us_main=main_us,
                   tbs_main=k * n * 2 / main_us / 1e6, rel_err=err, ok=err < 2e-2)
        rows.append(row)
        print(f"{shape} {name:32s} main {main_us:7.2f} us ({row['tbs_main']:.2f} TB/s)  "
              f"total {total:7.2f} us  rel err {err:.1e}", flush=True)
    return rows, failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--bodies", default="32x128x6",
                   help="block_n x block_k x stages, each as kernels and persistent")
    p.add_argument("--wa-bodies", default="64x128x8x1,64x128x12x1,64x128x8x2,64x128x10x2,64x256x5x2",
                   help="the transposed form: block_n x block_k x stages x K split, \"w\" at the end: "
                        "the phase's x loaded whole")
    p.add_argument("--variants", default="kernels,persistent,ring,nobarrier")
    p.add_argument("--stream", default="",
                   help="single products instead of the chain: 'KxN:body+body;KxN:...', "
                        "body = block_n x block_k x stages x split x programs")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("persistent_mgpu_probe: needs an NVIDIA GPU", file=sys.stderr)
        return 1
    if args.stream:
        rows, failures = [], 0
        for spec in args.stream.split(";"):
            shape, bodies = spec.split(":")
            r, f = time_products(shape, [b for b in bodies.split("+") if b])
            rows += r
            failures += f
        return finish(rows, failures, args.json)
    d = args.dim
    sms = jax.devices()[0].core_count
    keys = jax.random.split(jax.random.key(0), 2)
    x = jnp.zeros((MP, d), jnp.bfloat16).at[0].set(
        jax.random.normal(keys[0], (d,), jnp.float32).astype(jnp.bfloat16))
    weights = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
               for k in jax.random.split(keys[1], args.layers)]
    want = jax.jit(chain_reference)(x, weights)
    wanted = set(args.variants.split(","))
    cases = [("xla", chain_reference, x, False), ("norm_matmul (production)", chain_norm_matmul,
                                                  x, False)]
    for body in (b for b in args.bodies.split(",") if b):
        bn, bk, st = (int(v) for v in body.split("x"))
        cfg = DecodeMatmulConfig(block_n=bn, block_k=bk, stages=st)
        if "kernels" in wanted:
            cases.append((f"mosaic kernels {body}",
                          functools.partial(chain_mosaic_kernels, cfg=cfg), x, False))
        if d // bn > sms:
            print(f"persistent {body}: {d // bn} programs > {sms} SMs, skipped", flush=True)
            continue
        if "persistent" in wanted:
            cases.append((f"persistent {body}",
                          functools.partial(chain_persistent, cfg=cfg, ring=False), x, False))
        if "ring" in wanted:
            cases.append((f"persistent {body} +ring",
                          functools.partial(chain_persistent, cfg=cfg, ring=True), x, False))
        if "nobarrier" in wanted:
            cases.append((f"persistent {body} +ring nobarrier",
                          functools.partial(chain_persistent, cfg=cfg, ring=True, barrier=False),
                          x, True))
    for body in (b for b in args.wa_bodies.split(",") if b):
        whole_x = body.endswith("w")  # "...w": the phase's x loaded whole
        bn, bk, st, split = (int(v) for v in body.rstrip("w").split("x"))
        cfg = DecodeMatmulConfig(block_n=bn, block_k=bk, stages=st)
        if d // bn * split > sms:
            print(f"wa {body}: {d // bn * split} programs > {sms} SMs, skipped", flush=True)
            continue
        kw = dict(cfg=cfg, split=split, whole_x=whole_x)
        cases.append((f"wa {body}", functools.partial(chain_persistent_wa, **kw), x, False))
        if "nobarrier" in wanted:
            cases.append((f"wa {body} nobarrier", functools.partial(
                chain_persistent_wa, barrier=False, **kw), x, True))
    rows, failures = measure_all(cases, weights, want, dim=d, layers=args.layers,
                                 repeats=args.repeats, label=f"D={d} ")
    return finish(rows, failures, args.json)


if __name__ == "__main__":
    sys.exit(main())
