"""Does a launch path of our own (an XLA FFI call) give Pallas kernels PDL inside XLA's executable?

    PYTHONPATH=. python3 benchmarks/pdl_ffi_probe.py [--dim 4096] [--layers 16] [--json FILE]

XLA (jax 0.11.2) launches Pallas Triton kernels without the PDL attribute (pdl_probe.py,
`triton-pdl nowait`: no overlap). With Triton's own launcher in a CUDA graph, the same GEMV
chain overlaps (pdl_launch_probe.py: ~0.8-1.5 us per product with a correct wait). This probe
takes the Pallas kernel of pdl_probe.py (`triton_pdl_gemv`, with `gdc_launch_dependents` and
`gdc_wait` at its start), lowers it to Triton IR as XLA would receive it, compiles that with the
machine's Triton (3.6) to a cubin, and launches the chain of `--layers` products from one XLA FFI
call (benchmarks/pdl_ffi_launch.cc, built here with g++) that sets
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, inside a jitted loop (XLA's command
buffers capture the call). Against: the same kernel launched by XLA (pallas_call), and the FFI
call without the attribute. Every chain is checked against jnp. Needs a Hopper GPU, g++, CUDA's
headers and Triton; nothing here is used by the engine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.chain_timing import finish, measure_all
from benchmarks.pdl_probe import chain, triton_pdl_gemv, variants
from benchmarks.triton_asm import triton_modules

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = "jaxinfer_pdl_chain"


def build_launcher(out_dir: str) -> ctypes.CDLL:
    """Compiles pdl_ffi_launch.cc and registers its FFI handler."""
    lib_path = os.path.join(out_dir, "libpdl_ffi_launch.so")
    cmd = ["g++", "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
           "-I/usr/local/cuda/include", os.path.join(HERE, "pdl_ffi_launch.cc"), "-o", lib_path]
    subprocess.run(cmd, check=True)
    ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)  # the driver API our library calls
    lib = ctypes.CDLL(lib_path)
    lib.jaxinfer_pdl_load_kernel.restype = ctypes.c_int64
    lib.jaxinfer_pdl_load_kernel.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                             ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                                             ctypes.c_char_p, ctypes.c_int]
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferPdlChain),
                                platform="CUDA")
    return lib


def triton_ir(fn, *args) -> str:
    """The Triton IR that Pallas hands XLA for the one pallas_call in fn(*args)."""
    with triton_modules() as seen:
        jax.jit(fn).lower(*args)
    assert len(seen) == 1, f"expected one Triton module, got {len(seen)}"
    return seen[0]


def load_compiled(lib, kernel, n_buffers: int, num_warps: int, label: str) -> int:
    """Loads a kernel compiled by triton.compile into our launcher: its id."""
    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", kernel.asm["ptx"], re.S)
    n_ptx = entry.group(2).count(".param")
    err = ctypes.create_string_buffer(512)
    kid = lib.jaxinfer_pdl_load_kernel(kernel.asm["cubin"], entry.group(1).encode(), 0,
                                       32 * num_warps, kernel.metadata.shared,
                                       n_ptx - n_buffers, err, len(err))
    if kid < 0:
        raise RuntimeError(err.value.decode())
    print(f"kernel {label}: {n_buffers} buffers + {n_ptx - n_buffers} extra params, "
          f"{kernel.metadata.shared} B shared, {num_warps} warps", flush=True)
    return kid


def load_source_kernel(lib, trigger: int, wait: int, bn: int, bk: int, st: int, d: int) -> int:
    """pdl_launch_probe.gemv_kernel (Triton source, not Pallas IR) compiled the same way: tells
    the launch path's cost from the Pallas IR's."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.pdl_launch_probe import gemv_kernel

    consts = dict(K=d, N=d, BLOCK_N=bn, BLOCK_K=bk, TRIGGER=trigger, WAIT=wait)
    sig = dict(x_ptr="*bf16", w_ptr="*bf16", o_ptr="*bf16", **{c: "constexpr" for c in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}  # as Triton's launcher sees
    kernel = triton.compile(ASTSource(fn=gemv_kernel, signature=sig, constexprs=consts,
                                      attrs=aligned),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=4, num_stages=st))
    return load_compiled(lib, kernel, 3, 4, f"source trigger {trigger} wait {wait}")


def load_kernel(lib, ttir: str, num_warps: int, num_stages: int, workdir: str) -> int:
    """Compiles Triton IR with the machine's Triton for sm_90a and loads it: the kernel id."""
    import triton
    from triton.backends.compiler import GPUTarget

    # Upstream Triton 3.6 may not know the grid-dependency ops of jaxlib's dialect: the same
    # instructions as volatile inline asm (what triton.language.extra.cuda emits).
    n = [0]

    def asm(instr):
        def sub(_):
            n[0] += 1
            return (f'%gdc{n[0]} = tt.elementwise_inline_asm "{instr}; // dummy $0" '
                    '{constraints = "=r", packed_element = 1 : i32, pure = false} -> i32')
        return sub

    ttir = re.sub(r"tt\.grid_dependency_wait\b", asm("griddepcontrol.wait"), ttir)
    ttir = re.sub(r"tt\.grid_dependency_launch_dependents\b",
                  asm("griddepcontrol.launch_dependents"), ttir)
    name = re.search(r"tt\.func (?:public )?@(\w+)", ttir).group(1)
    path = os.path.join(workdir, f"{name}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    n_ttir = re.search(r"tt\.func[^(]*\(([^)]*)\)", ttir).group(1).count("%arg")
    return load_compiled(lib, kernel, n_ttir, num_warps, f"{name} {num_stages} stages")


def ffi_chain(kid: int, grid: int, pdl: int, calls: str = "one"):
    """fn(x, weights): the GEMV chain through our FFI call (calls="one": one call for all
    launches; "each": one call per product)."""
    def fn(x, weights):
        layers = len(weights)
        if calls == "each":
            for w in weights:
                x, = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype)])(
                    x, w, kernels=np.array([kid], np.int64),
                    grids=np.array([grid, 1, 1], np.int64), nparams=np.array([3], np.int64),
                    params=np.array([0, 1, 2], np.int64), pdl=np.int64(2 if pdl else 0))
            return x
        # buffers: x = 0, weights 1..L, results L+1..2L (result l is product l's output)
        params = []
        for l in range(layers):
            params += [0 if l == 0 else layers + l, 1 + l, layers + 1 + l]
        outs = jax.ffi.ffi_call(TARGET, [jax.ShapeDtypeStruct(x.shape, x.dtype)] * layers)(
            x, *weights, kernels=np.full(layers, kid, np.int64),
            grids=np.array([grid, 1, 1] * layers, np.int64),
            nparams=np.full(layers, 3, np.int64), params=np.array(params, np.int64),
            pdl=np.int64(pdl))
        return outs[-1]
    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--blocks", default="32x256x8,32x256x3", help="block_n x block_k x stages")
    p.add_argument("--layouts", default="rows,flat", help="triton_pdl_gemv layouts")
    p.add_argument("--loop", action="store_true",
                   help="repeat the chain in a jitted fori_loop (default: written out)")
    p.add_argument("--source-kernel", action="store_true",
                   help="also launch pdl_launch_probe's Triton-source kernel (needs torch)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("pdl_ffi_probe: needs an NVIDIA GPU (Hopper or newer)", file=sys.stderr)
        return 1
    d, layers = args.dim, args.layers
    workdir = tempfile.mkdtemp(prefix="pdl_ffi_")
    lib = build_launcher(workdir)
    keys = jax.random.split(jax.random.key(d), layers + 1)
    x = jax.random.normal(keys[0], (1, d), jnp.float32).astype(jnp.bfloat16)
    weights = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
               for k in keys[1:]]

    xla_dot = variants([], ())["xla"]
    want = jax.jit(functools.partial(chain, xla_dot))(x, weights)
    cases = [("xla dot", functools.partial(chain, xla_dot), x, False)]
    for blocks in args.blocks.split(","):
        bn, bk, st = (int(v) for v in blocks.split("x"))
        grid = d // bn
        for layout in args.layouts.split(","):
            gemv = functools.partial(triton_pdl_gemv, block_n=bn, block_k=bk, stages=st,
                                     layout=layout)
            kids = {mode: load_kernel(lib, triton_ir(functools.partial(gemv, mode=mode), x,
                                                     weights[0]), 4, st, workdir)
                    for mode in ("plain", "start", "nowait")}
            tag = f"{blocks} {layout} "
            cases += [
                (tag + "xla pallas_call plain", functools.partial(chain, functools.partial(
                    gemv, mode="plain")), x, False),
                (tag + "xla pallas_call start", functools.partial(chain, functools.partial(
                    gemv, mode="start")), x, False),
                (tag + "ffi plain, no pdl", ffi_chain(kids["plain"], grid, 0), x, False),
                (tag + "ffi start, no pdl", ffi_chain(kids["start"], grid, 0), x, False),
                (tag + "ffi start, pdl", ffi_chain(kids["start"], grid, 1), x, False),
                (tag + "ffi start, pdl, call each", ffi_chain(kids["start"], grid, 1, "each"),
                 x, False),
                (tag + "ffi race: nowait, pdl", ffi_chain(kids["nowait"], grid, 1), x, True),
            ]
        if args.source_kernel:
            src_plain = load_source_kernel(lib, 0, 0, bn, bk, st, d)
            src_start = load_source_kernel(lib, 1, 1, bn, bk, st, d)
            cases += [(f"{blocks} ffi source plain, no pdl", ffi_chain(src_plain, grid, 0), x,
                       False),
                      (f"{blocks} ffi source start, pdl", ffi_chain(src_start, grid, 1), x,
                       False)]
    rows, failures = measure_all(cases, weights, want, dim=d, layers=layers,
                                 repeats=args.repeats, unroll=not args.loop)
    return finish(rows, failures, args.json)


if __name__ == "__main__":
    sys.exit(main())
