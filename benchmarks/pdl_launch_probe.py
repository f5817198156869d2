"""What would PDL give the decode matmul chain with a launch path that honours it?

    python3 benchmarks/pdl_launch_probe.py [--dim 4096] [--layers 16] [--repeats 20]

XLA (jax 0.11.2) launches Pallas Triton kernels without the PDL attribute, whatever the kernel
holds (`benchmarks/pdl_probe.py`, the `triton-pdl nowait` variant: no overlap). Before building a
launch path of our own (an XLA FFI call that launches the kernels with
cudaLaunchAttributeProgrammaticStreamSerialization), this probe measures the ceiling: the same
chain of `--layers` products x [1, D] @ w_l [D, D] (separate weights, more than L2), written in
Triton, launched by Triton's own launcher with and without `launch_pdl`, captured in a CUDA graph
(as XLA's command buffers would hold it) and replayed. Needs torch and triton (the H200 image has
both); nothing of jaxinfer runs here.

Variants (CASES): where the kernel lets its successor launch (launch_dependents: at the start or
after its main loop) and where it waits for its predecessor (at the start; after the first weight
tile's load, peeled out of the loop).
Prints us per product and TB/s, and checks each chain against torch.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

HBM_TBS = 4.27


@triton.jit
def _wait():
    # As triton.language.extra.cuda.gdc_wait: a volatile asm whose dummy result nothing uses.
    # (A result used in the x address hides its alignment: unvectorized, unpipelined loads,
    # +6 us per product in the first run.)
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _wait_token():
    return tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _launch_dependents():
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.u32 $0, 0;", "=r", [],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gemv_kernel(x_ptr, w_ptr, o_ptr, K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, TRIGGER: tl.constexpr, WAIT: tl.constexpr):
    # x [1, K] (row 0 of the dot's 16), w [K, N] row-major, o [1, N]; one program per BLOCK_N
    # columns. TRIGGER (launch_dependents): 0 none, 1 at the start, 2 after the main loop,
    # 3 half-way through it.
    # WAIT: 0 none (a race), 1 at the start, 2 after the first weight tile's load (peeled),
    # 4 after the first two, 5 in the loop before each x load, 6 in the loop as a token
    # in the x address, 7 in the loop's first iteration (x then held in registers), 8 the same with
    # each x tile loaded one iteration ahead.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if TRIGGER == 1:
        _launch_dependents()
    if WAIT == 1:
        _wait()
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    xall = tl.zeros((K // BLOCK_K, BLOCK_K), tl.bfloat16)  # WAIT 7: all of x, in registers
    xcur = tl.zeros((BLOCK_K,), tl.bfloat16)  # WAIT 8: this iteration's x tile, loaded ahead
    k0 = 0
    if WAIT == 2:
        ks = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + ks[:, None] * N + cols[None, :])
        _wait()
        x = tl.load(x_ptr + ks)
        acc += tl.dot(tl.broadcast_to(x[None, :], (16, BLOCK_K)), w)
        k0 = BLOCK_K
    if WAIT == 4:  # two tiles before the wait
        ks = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + ks[:, None] * N + cols[None, :])
        w2 = tl.load(w_ptr + (ks + BLOCK_K)[:, None] * N + cols[None, :])
        _wait()
        x = tl.load(x_ptr + ks)
        x2 = tl.load(x_ptr + BLOCK_K + ks)
        acc += tl.dot(tl.broadcast_to(x[None, :], (16, BLOCK_K)), w)
        acc += tl.dot(tl.broadcast_to(x2[None, :], (16, BLOCK_K)), w2)
        k0 = 2 * BLOCK_K
    for k in range(k0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + ks[:, None] * N + cols[None, :])
        if WAIT == 5:  # in the loop, before the x load: a race (the pipeliner issues the
            # prologue's x loads before it; seen in the PTX, not by this probe's check)
            _wait()
        if WAIT == 6:  # in the loop, the x address taking the wait's (aligned) token
            ks = ks + tl.multiple_of(_wait_token(), 256)
        if WAIT == 7:
            # The pipeliner hoists a loop's loads above anything in it (WAIT 5 races), but not
            # a load under an `if`: the first iteration waits, then loads all of x (after the
            # prologue's weight tiles); each iteration takes its tile out by a masked sum.
            if k == 0:
                _wait()
                rk = tl.arange(0, K // BLOCK_K)[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
                xall = tl.load(x_ptr + rk)
            sel = tl.arange(0, K // BLOCK_K)[:, None] == k // BLOCK_K
            x = tl.sum(tl.where(sel, xall.to(tl.float32), 0.0), axis=0).to(tl.bfloat16)
        elif WAIT == 8:
            # As 7, but each x tile is loaded one iteration ahead into the loop's carry (a load
            # whose result is carried is not pipelined, so it stays after the wait).
            if k == 0:
                _wait()
                xcur = tl.load(x_ptr + tl.arange(0, BLOCK_K))
            x = xcur
            xcur = tl.load(x_ptr + (k + BLOCK_K) % K + tl.arange(0, BLOCK_K))
        else:
            x = tl.load(x_ptr + ks)
        acc += tl.dot(tl.broadcast_to(x[None, :], (16, BLOCK_K)), w)
        if TRIGGER == 3:
            if k == K // 2:
                _launch_dependents()
    if TRIGGER == 2:
        _launch_dependents()
    out = tl.sum(tl.where(tl.arange(0, 16)[:, None] == 0, acc, 0.0), axis=0)
    tl.store(o_ptr + cols, out.to(o_ptr.dtype.element_ty))



@triton.jit
def split_gemv_kernel(x_ptr, w_ptr, o_ptr, K: tl.constexpr, N: tl.constexpr, KC: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """norm_matmul's plain split-K decode matmul written in Triton (ttir_inject_probe.py swaps
    its IR into norm_matmul's pallas_call): program (0, N tile, K chunk of KC rows) writes the
    float32 partial out[chunk, 0, tile] of x [1, K] @ w [K, N]. MASKED: x read as a [16,
    BLOCK_K] block with rows >= 1 masked (norm_matmul's form); else as [BLOCK_K], broadcast."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    part = tl.program_id(2)
    acc = tl.zeros((16, BLOCK_N), tl.float32)
    rows = tl.arange(0, 16)
    for kk in range(0, KC, BLOCK_K):
        ks = part * KC + kk + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + ks[:, None] * N + cols[None, :])
        if MASKED:
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rows[:, None] < 1,
                        other=0.0)
        else:
            x = tl.broadcast_to(tl.load(x_ptr + ks)[None, :], (16, BLOCK_K))
        acc = tl.dot(x, w, acc)
    out = tl.sum(tl.where(rows[:, None] == 0, acc, 0.0), axis=0)
    tl.store(o_ptr + part * N + cols, out)


def chain(x, weights, outs, trigger: int, wait: int, pdl: bool, block_n: int, block_k: int,
          stages: int):
    d = x.shape[1]
    for w, o in zip(weights, outs):
        gemv_kernel[(d // block_n,)](x, w, o, K=d, N=d, BLOCK_N=block_n, BLOCK_K=block_k,
                                     TRIGGER=trigger, WAIT=wait, num_warps=4,
                                     num_stages=stages, launch_pdl=pdl)
        x = o
    return x


# (name, trigger, wait, launch with PDL); "race" variants are wrong by design (the most that
# overlapping can give).
CASES = [("plain", 0, 0, False), ("trigger end, wait start", 2, 1, True),
         ("trigger start, wait start", 1, 1, True), ("trigger start, wait peeled", 1, 2, True),
         ("trigger start, wait peeled 2", 1, 4, True), ("trigger mid, wait peeled", 3, 2, True),
         ("race: trigger start, wait in loop (x loads hoisted above it)", 1, 5, True),
         ("trigger start, wait token in loop", 1, 6, True),
         ("trigger start, wait in loop's first iteration, x in registers", 1, 7, True),
         ("trigger start, wait in loop's first iteration, x loaded ahead", 1, 8, True),
         ("race: trigger start", 1, 0, True)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--blocks", default="32x256x3,32x256x8,32x512x4,64x256x4,64x512x2",
                   help="block_n x block_k x stages variants")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    d, layers = args.dim, args.layers
    torch.manual_seed(0)
    x0 = torch.randn(1, d, device="cuda").bfloat16()
    weights = [(torch.randn(d, d, device="cuda") / d ** 0.5).bfloat16() for _ in range(layers)]
    outs = [torch.empty(1, d, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    want = x0.float()
    for w in weights:
        want = (want @ w.float()).bfloat16().float()
    rows = []
    for blocks in args.blocks.split(","):
        bn, bk, st = (int(v) for v in blocks.split("x"))
        for name, trigger, wait, pdl in CASES:
            try:
                x = x0.clone()
                got = chain(x, weights, outs, trigger, wait, pdl, bn, bk, st)
                torch.cuda.synchronize()
                err = float((got.float() - want).norm() / want.norm())
                graph = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                with torch.cuda.stream(stream):
                    chain(x, weights, outs, trigger, wait, pdl, bn, bk, st)  # warm, off the graph
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph, stream=stream):
                        for _ in range(args.repeats):
                            chain(x, weights, outs, trigger, wait, pdl, bn, bk, st)
                graph.replay()
                torch.cuda.synchronize()
                times = []
                for _ in range(5):
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    graph.replay()
                    t1.record()
                    torch.cuda.synchronize()
                    times.append(t0.elapsed_time(t1) / 1e3)
            except Exception as e:  # one failing variant does not hide the others
                print(f"{blocks} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            sec = min(times) / (args.repeats * layers)
            row = dict(blocks=blocks, variant=name, us=sec * 1e6, tbs=d * d * 2 / sec / 1e12,
                       rel_err=err)
            rows.append(row)
            print(f"{blocks:10s} {name:22s} {row['us']:7.2f} us/product  {row['tbs']:.2f} TB/s  "
                  f"rel err {err:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
