"""Does the whole B=1 decode step gain when its Pallas kernels are launched by a call of our own,
with programmatic dependent launch (PDL)?

    PYTHONPATH=. python3 benchmarks/ffi_step_probe.py [--variants xla,off,wait,start,start1]
        [--preset llama3-8b] [--prompt-len 128] [--steps 32] [--json FILE]

Why: XLA (jax 0.11.2) launches Pallas Triton kernels without the PDL attribute (run J,
benchmarks/NOTES.md), and each of the step's ~160 Pallas kernels loses ~2.5 us to its ramp and
tail. Run J measured PDL only on synthetic GEMV chains: honoured through our FFI call
(pdl_ffi_launch.cc), worth 0.5-0.9 us per product against the same call without it, but only
for kernels that fit one CTA per SM. This probe measures the real step.

How: while the decode loop is lowered, every Pallas Triton custom call is replaced. Its Triton
module (as XLA would receive it) is compiled by the machine's Triton (3.6, torch's) for sm_90a,
the cubin is loaded into our launcher, and the call becomes an XLA FFI custom call to
`jaxinfer_pdl_chain` with the same operands, results and aliases: one launch, same grid.
Variants (`--variants`):
  xla      the default: XLA compiles and launches the Pallas kernels;
  off      our launch path, no PDL instructions, no attribute (the cost of the path itself);
  wait     griddepcontrol.wait at each kernel's start, launched with the PDL attribute: the
           launch overlaps the predecessor's tail (the implicit trigger is each program's exit);
  start    griddepcontrol.launch_dependents + wait at the start: the next kernel's programs
           may take SMs as soon as they are free;
  start1   `start`, and kernels of at most one wave get >= 116 KB of dynamic shared memory,
           so that one CTA fits per SM (run J: PDL paid only for such kernels);
  race     launch_dependents at the start and no wait: wrong by design, a bound on what
           overlapping the kernels could give (and a check that PDL is honoured at all);
  chain    the wait, then launch_dependents: the next kernel's programs take free SMs and wait
           there while this one runs, but no further kernel launches before this one's wait
           returns (`start` lets a whole chain of waiting kernels pile onto the SMs);
  late     the wait at the start, launch_dependents after the main loop;
  chain1, late1: with one CTA per SM, as start1;
  free     no wait, launch_dependents after the main loop (for overrides: one kernel racing);
  cudaR    (an override of the o projection only) benchmarks/pdl_stream_gemv.cu instead of the
           Pallas kernel: R rows of each block's weight tile staged in shared memory before the
           wait, the rest read after it; correct, unlike `free`. cudaRxB: B column blocks per
           K chunk instead of 64 (62: 124 blocks, which fit beside the attention's 8).
A variant may end in per-kernel overrides, "+MODE@SUBSTR": e.g.
"late+start@decode_attention+free@k4096_n4096" races only the o projection against the
attention kernel (the attention lets it launch at its start; the rest as `late`), a bound on
what that one boundary could give.
XLA's command buffers (CUDA graphs) capture our calls and lose PDL across them (session 14:
the race variant ran no faster and gave no overlap); run with
XLA_FLAGS=--xla_gpu_enable_command_buffer= to launch in stream order, where PDL is honoured.
`--trace` also profiles one run of each variant: kernel time, traced span, and the mean gap
from one Pallas kernel's end to the next one's start (negative: they overlapped).
Each variant's generated tokens and K cache (first and last layer) are compared with the first
variant's and with the first FFI variant's (the same Triton 3.6 numerics: our path rounds
differently from XLA's Triton, so only the second comparison shows what PDL changed); the wall
time per step is the best of `--repeats` runs, the variants timed in turn, `--rounds` times.
Results: benchmarks/NOTES.md run O. Needs an NVIDIA Hopper GPU, g++, CUDA's headers and Triton
(nvcc or NVRTC for `cudaR`); nothing here is used by the engine.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import sys
import tempfile
import time

import jax
import numpy as np

TARGET = "jaxinfer_pdl_chain"  # the FFI handler of pdl_ffi_launch.cc
PALLAS_TARGET = "__gpu$xla.gpu.triton"
ONE_CTA_SMEM = 116 * 1024  # > half of an H100/H200 SM's 228 KB: one CTA per SM
NUM_SMS = 132
GDC = {"wait": "griddepcontrol.wait", "trigger": "griddepcontrol.launch_dependents"}
# mode: (instructions at the kernel's start, launch_dependents after the main loop, one CTA per
# SM for kernels of at most one wave)
PDL_MODES = {
    "off": ((), False, False),
    "wait": (("wait",), False, False),
    "start": (("trigger", "wait"), False, False),
    "start1": (("trigger", "wait"), False, True),
    "race": (("trigger",), False, False),
    "chain": (("wait", "trigger"), False, False),
    "chain1": (("wait", "trigger"), False, True),
    "late": (("wait",), True, False),
    "late1": (("wait",), True, True),
    "free": ((), True, False),  # no wait (races its predecessor), launch_dependents late
}
MODES = tuple(PDL_MODES)

_ASM = ('%{name} = tt.elementwise_inline_asm "{instr}; // dummy $0" '
        '{{constraints = "=r", packed_element = 1 : i32, pure = false}} -> i32')


def with_pdl(ttir: str, mode: str) -> str:
    """The Triton IR with the PDL instructions of `mode` (PDL_MODES) as volatile inline asm, the
    form upstream Triton's `gdc_*` helpers emit: those of the function's start in order, and for
    the "late" modes launch_dependents after the function's first top-level loop (its main loop;
    before the return when it has none). Any of jaxlib's `tt.grid_dependency_*` ops become the
    same asm (upstream Triton may not know them)."""
    if mode not in PDL_MODES:
        raise ValueError(f"PDL mode {mode!r}: not one of {sorted(PDL_MODES)}")
    n = [0]

    def asm(instr):
        n[0] += 1
        return f"    {_ASM.format(name=f'jaxinfer_gdc{n[0]}', instr=GDC[instr])}\n"

    ttir = re.sub(r"tt\.grid_dependency_wait\b", lambda _: asm("wait").strip(), ttir)
    ttir = re.sub(r"tt\.grid_dependency_launch_dependents\b",
                  lambda _: asm("trigger").strip(), ttir)
    at_start, late, _ = PDL_MODES[mode]
    lines = ttir.splitlines(keepends=True)
    head = next((i for i, ln in enumerate(lines) if re.match(r"\s*tt\.func .*\{\s*$", ln)), None)
    if head is None:
        raise ValueError("no tt.func in the Triton module")
    if late:
        loop = next((i for i, ln in enumerate(lines) if re.match(r"    %\S+ = scf\.for ", ln)),
                    None)
        if loop is None:
            end = max(i for i, ln in enumerate(lines) if ln.strip().startswith("tt.return"))
        else:  # the loop's closing brace, at the function body's indentation
            end = next(i for i in range(loop + 1, len(lines)) if lines[i].rstrip() == "    }") + 1
        lines.insert(end, asm("trigger"))
    lines[head + 1:head + 1] = [asm(i) for i in at_start]
    return "".join(lines)


def compile_ttir(ttir: str, num_warps: int, num_stages: int, workdir: str) -> dict:
    """Compiles Triton IR with the installed Triton for sm_90a: cubin, entry name, number of PTX
    parameters, shared memory, registers, scratch sizes."""
    import triton
    from triton.backends.compiler import GPUTarget

    name = re.search(r"tt\.func (?:public )?@(\w+)", ttir).group(1)
    digest = hashlib.sha1(ttir.encode()).hexdigest()[:12]
    path = os.path.join(workdir, f"{name}_{digest}.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    entry = re.search(r"\.entry\s+(\w+)\s*\(([^)]*)\)", kernel.asm["ptx"], re.S)
    md = kernel.metadata
    n_args = re.search(r"tt\.func[^(]*\(([^)]*)\)", ttir).group(1).count("%arg")
    return dict(cubin=kernel.asm["cubin"], entry=entry.group(1), n_args=n_args,
                n_ptx_params=entry.group(2).count(".param"), shared=int(md.shared),
                n_regs=int(getattr(kernel, "n_regs", 0) or 0),
                global_scratch=int(getattr(md, "global_scratch_size", 0) or 0),
                profile_scratch=int(getattr(md, "profile_scratch_size", 0) or 0),
                num_warps=num_warps)


class Launcher:
    """Turns each Pallas Triton custom call lowered inside `install()` into an FFI call to our
    launcher. `load(info, shared) -> kernel id` loads a compiled kernel (ctypes on the GPU; any
    counter in a CPU test). Compiled kernels are cached by their IR and options, so the step's
    ~160 calls compile ~6 distinct kernels."""

    def __init__(self, mode: str, load, workdir: str | None = None):
        """mode: a PDL_MODES key, optionally followed by per-kernel overrides
        "+MODE@SUBSTR" (kernels whose name holds SUBSTR use MODE; the first match counts)."""
        base, *overrides = mode.split("+")
        self.overrides = [tuple(o.split("@", 1)) for o in overrides]
        bad = [o for o in self.overrides if len(o) != 2 or not o[1]
               or (o[0] not in MODES and not re.fullmatch(r"cuda\d+(x\d+)?", o[0]))]
        if base not in MODES or bad:
            raise ValueError(f"mode {mode!r}: not one of {MODES}, optionally followed by "
                             "+MODE@SUBSTR overrides")
        self.mode = base
        self.load = load
        self.workdir = workdir or tempfile.mkdtemp(prefix="ffi_step_")
        self.compiled: dict = {}
        self.kernels: list[dict] = []  # one row per distinct kernel: name, grid, smem, regs

    def kernel_id(self, ttir: str, num_warps: int, num_stages: int, grid) -> tuple:
        """(the launcher's id of the kernel compiled from `ttir`, its number of pointers, the
        launch grid)."""
        name = re.search(r"tt\.func (?:public )?@(\w+)", ttir).group(1)
        mode = next((m for m, sub in self.overrides if sub in name), self.mode)
        if mode.startswith("cuda"):  # pdl_stream_gemv.cu in place of the Pallas kernel
            if mode not in self.compiled:
                if not re.fullmatch(r"\w*_k4096_n4096_split2", name):
                    raise ValueError(f"{mode}: pdl_stream_gemv replaces only the 4096 x 4096 "
                                     f"split-2 partials matmul, not {name}")
                spec = stream_gemv_spec(mode)
                kid = self.load(spec, spec["shared"])
                self.compiled[mode] = (kid, 3, spec["grid"])
                self.kernels.append(dict(name="pdl_stream_gemv", mode=mode, **spec))
            return self.compiled[mode]
        text = with_pdl(ttir, mode)
        n_programs = grid[0] * grid[1] * grid[2]
        key = (text, num_warps, num_stages)
        if key not in self.compiled:
            self.compiled[key] = compile_ttir(text, num_warps, num_stages, self.workdir)
        info = self.compiled[key]
        if info["global_scratch"] or info["profile_scratch"]:
            raise NotImplementedError(f"{info['entry']}: needs Triton scratch memory "
                                      f"({info['global_scratch']} B), which the launcher "
                                      "passes as null")
        shared = info["shared"]
        if PDL_MODES[mode][2] and n_programs <= NUM_SMS:
            shared = max(shared, ONE_CTA_SMEM)
        lkey = (key, shared)
        if lkey not in self.compiled:
            self.compiled[lkey] = (self.load(info, shared), info["n_args"], tuple(grid))
            self.kernels.append(dict(name=info["entry"], mode=mode, grid=list(grid),
                                     warps=num_warps,
                                     stages=num_stages, shared=info["shared"],
                                     launch_shared=shared, regs=info["n_regs"]))
        return self.compiled[lkey]

    @contextlib.contextmanager
    def install(self):
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import pallas_call_registration as reg

        from benchmarks.triton_asm import triton_modules

        launcher = self

        class MlirProxy:  # pallas_call_registration's `mlir`, with custom_call replaced
            def __getattr__(self, attr):
                return getattr(mlir, attr)

            @staticmethod
            def custom_call(call_target_name, *, result_types, operands, backend_config,
                            operand_output_aliases=None, **kw):
                assert call_target_name == PALLAS_TARGET, call_target_name
                cfg = {k: ir.IntegerAttr(backend_config[k]).value
                       for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
                grid = (cfg["grid_x"], cfg["grid_y"], cfg["grid_z"])
                kid, n_args, grid = launcher.kernel_id(seen[-1], cfg["num_warps"],
                                                       cfg["num_stages"], grid)
                n = len(operands) + len(result_types)  # Pallas: inputs, then outputs
                if n_args != n:
                    raise ValueError(f"the kernel takes {n_args} pointers, the call has {n}")
                attrs = dict(kernels=np.array([kid], np.int64),
                             grids=np.array(grid, np.int64),
                             nparams=np.array([n], np.int64),
                             params=np.arange(n, dtype=np.int64),
                             pdl=np.int64(0 if launcher.mode == "off" else 2))
                return mlir.custom_call(
                    TARGET, result_types=result_types, operands=operands,
                    backend_config={k: mlir.ir_attribute(v) for k, v in attrs.items()},
                    operand_output_aliases=operand_output_aliases, **kw)

        with triton_modules() as seen:
            reg.mlir = MlirProxy()
            try:
                yield self
            finally:
                reg.mlir = mlir


def stream_gemv_spec(mode: str) -> dict:
    """pdl_stream_gemv's build and launch for an override "cudaR" or "cudaRxB" (R staged rows,
    B column blocks per K chunk, default 64): defines, grid, threads, dynamic shared memory
    (the staged rows or the reduction's floats, then x's 2048-element chunk)."""
    m = re.fullmatch(r"cuda(\d+)(?:x(\d+))?", mode)
    if m is None:
        raise ValueError(f"{mode!r}: not cudaR or cudaRxB")
    pre, nblk = int(m.group(1)), int(m.group(2) or 64)
    max_vec = -(-512 // nblk)  # 16-byte vectors per block, at most (N = 4096)
    if not 0 <= pre <= 2048 or max_vec > 16:
        raise ValueError(f"{mode!r}: R must be 0..2048 rows and B >= 32 blocks")
    shared = max(pre * max_vec * 16, 32 * max_vec * 8 * 4) + 2048 * 2
    if shared > 227 * 1024:
        raise ValueError(f"{mode!r}: {shared} B of shared memory, more than the 227 KB a block "
                         "may take")
    return dict(defines=[f"-DPRE_ROWS={pre}", f"-DNBLK={nblk}"], grid=(nblk, 2, 1),
                threads=32 * max_vec, shared=shared)


def compile_stream_gemv(defines: list[str], workdir: str) -> bytes:
    """pdl_stream_gemv.cu for sm_90a with nvcc (a cubin), else NVRTC (PTX, which the driver
    compiles when the module loads)."""
    import glob
    import shutil
    import subprocess

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pdl_stream_gemv.cu")
    nvcc = shutil.which("nvcc") or next(iter(glob.glob("/usr/local/cuda*/bin/nvcc")), None)
    if nvcc:
        out = os.path.join(workdir, "pdl_stream_gemv" + "".join(defines).replace("-D", "_")
                           + ".cubin")
        subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-O3", *defines, src, "-o", out],
                       check=True)
        with open(out, "rb") as f:
            return f.read()
    return _nvrtc_ptx(open(src).read(), defines)


def _nvrtc_ptx(source: str, options: list[str]) -> bytes:
    import ctypes
    import glob
    import site

    roots = site.getsitepackages() + ["/usr/local/cuda"]
    libs = [p for r in roots for p in glob.glob(f"{r}/nvidia/cu*/lib/libnvrtc.so*")
            + glob.glob(f"{r}/nvidia/cuda_nvrtc/lib/libnvrtc.so*")
            + glob.glob(f"{r}/lib64/libnvrtc.so*")]
    if not libs:
        raise RuntimeError("pdl_stream_gemv: neither nvcc nor libnvrtc found")
    nvrtc = ctypes.CDLL(sorted(libs)[0])
    includes = [f"-I{p}" for r in roots for p in glob.glob(f"{r}/nvidia/cu*/include")
                + glob.glob(f"{r}/include")]
    opts = [o.encode() for o in ["--gpu-architecture=compute_90a", "-std=c++17",
                                 "--use_fast_math", *includes, *options]]
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"gemv.cu", 0, None,
                                  None)
    if rc != 0:
        raise RuntimeError(f"NVRTC could not create the program ({rc})")
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(f"NVRTC failed ({rc}): {log.value.decode()[:2000]}")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    return ptx.raw


def check_stream_gemv(lib, mode: str, workdir: str) -> float:
    """pdl_stream_gemv on random x [1, 4096], w [4096, 4096] against jnp's per-chunk sums:
    the relative error (launched without PDL through the same FFI call)."""
    import jax.numpy as jnp

    spec = stream_gemv_spec(mode)
    kid = gpu_loader(lib, workdir)(spec, spec["shared"])
    kx, kw = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (1, 4096), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (4096, 4096), jnp.float32) / 64).astype(jnp.bfloat16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((2, 1, 4096), jnp.float32))
    got = jax.jit(lambda x, w: call(
        x, w, kernels=np.array([kid], np.int64), grids=np.array(spec["grid"], np.int64),
        nparams=np.array([3], np.int64), params=np.arange(3, dtype=np.int64),
        pdl=np.int64(0)))(x, w)
    xf, wf = x.astype(jnp.float32), w.astype(jnp.float32)
    want = jnp.stack([xf[:, :2048] @ wf[:2048], xf[:, 2048:] @ wf[2048:]])
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def gpu_loader(lib, workdir: str):
    """load(info, shared) for Launcher, through pdl_ffi_launch.cc's jaxinfer_pdl_load_kernel."""
    import ctypes

    def load(info, shared):
        err = ctypes.create_string_buffer(512)
        if "defines" in info:  # stream_gemv_spec
            image = compile_stream_gemv(info["defines"], workdir)
            kid = lib.jaxinfer_pdl_load_kernel(image, b"pdl_stream_gemv", 0, info["threads"],
                                               shared, 0,
                                               err, len(err))
            if kid < 0:
                raise RuntimeError(f"pdl_stream_gemv: {err.value.decode()}")
            return kid
        # the PTX parameters past the IR's arguments: Triton's scratch pointers (passed null)
        kid = lib.jaxinfer_pdl_load_kernel(info["cubin"], info["entry"].encode(), 0,
                                           32 * info["num_warps"], shared,
                                           info["n_ptx_params"] - info["n_args"], err, len(err))
        if kid < 0:
            raise RuntimeError(f"{info['entry']}: {err.value.decode()}")
        return kid
    return load


def trace_stats(loop, params, state, steps: int, timeline: int = 0) -> dict:
    """One profiled run: kernel time and traced span per step (ms), kernels per step, and the
    mean end-to-start gap (us) between consecutive kernels of our Pallas chain (the kernels
    whose names hold "matmul", "attention" or "norm")."""
    from benchmarks.profile_decode import device_kernels, load_trace

    log_dir = tempfile.mkdtemp(prefix="ffi_trace_")
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
        jax.block_until_ready(loop(params, state))
    ks = sorted(device_kernels(load_trace(log_dir)), key=lambda e: float(e["ts"]))
    if timeline:
        from benchmarks.profile_decode import _timeline

        print(_timeline(ks, timeline), flush=True)
    busy = sum(float(e["dur"]) for e in ks) / steps
    span = (max(float(e["ts"]) + float(e["dur"]) for e in ks) - float(ks[0]["ts"])) / steps
    ours = re.compile(r"matmul|attention|norm")
    gaps = [float(b["ts"]) - (float(a["ts"]) + float(a["dur"])) for a, b in zip(ks, ks[1:])
            if ours.search(a["name"]) and ours.search(b["name"])]
    return dict(kernel_ms=round(busy / 1e3, 4), span_ms=round(span / 1e3, 4),
                kernels_per_step=round(len(ks) / steps, 1),
                gap_us=round(float(np.mean(gaps)), 3) if gaps else None,
                min_gap_us=round(float(np.min(gaps)), 3) if gaps else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--variants", default="xla,off,wait,start,start1")
    p.add_argument("--repeats", type=int, default=3, help="runs per timing (the best counts)")
    p.add_argument("--rounds", type=int, default=2, help="times each variant is timed, in turn")
    p.add_argument("--trace", action="store_true",
                   help="profile one run per variant: kernel time, span, gaps between kernels")
    p.add_argument("--timeline", type=int, default=0,
                   help="with --trace: print this many kernels around a middle attention kernel")
    p.add_argument("--blocks", default=None,
                   help="JSON block sizes of the decode matmuls, as profile_decode.py --blocks")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("ffi_step_probe: needs an NVIDIA GPU (Hopper or newer)", file=sys.stderr)
        return 1
    from benchmarks.pdl_ffi_probe import build_launcher
    from benchmarks.profile_decode import decode_setup
    from jaxinfer.generate import decode_loop

    variants = args.variants.split(",")
    for v in variants:
        if v != "xla":
            try:
                Launcher(v, load=None)
            except ValueError as e:
                p.error(f"--variants: {e}")
    if args.blocks:
        from benchmarks.profile_decode import _override_blocks

        _override_blocks(json.loads(args.blocks))
    workdir = tempfile.mkdtemp(prefix="ffi_step_")
    lib = build_launcher(workdir)
    model, fresh = decode_setup(args.preset, "bfloat16", args.batch, args.prompt_len, args.steps)
    cfg = model.config
    for m in sorted(set(re.findall(r"(cuda\d+(?:x\d+)?)@", args.variants))):
        print(f"pdl_stream_gemv {m}: rel err against jnp "
              f"{check_stream_gemv(lib, m, workdir):.2e}", flush=True)
    loops, checks, kernels = {}, {}, {}
    ref = ref_ffi = None
    for v in variants:
        jax.clear_caches()  # the decode loop is lowered again, through the hook or not
        t0 = time.perf_counter()
        s = fresh()
        if v == "xla":
            loops[v] = decode_loop.lower(model.params, s, cfg).compile()
        else:
            launcher = Launcher(v, gpu_loader(lib, workdir), workdir)
            with launcher.install():
                loops[v] = decode_loop.lower(model.params, s, cfg).compile()
            kernels[v] = launcher.kernels
        out = jax.block_until_ready(loops[v](model.params, s))
        got = (np.asarray(out.output), np.asarray(out.cache.k[0], np.float32),
               np.asarray(out.cache.k[-1], np.float32))
        # against the first variant, and the first FFI variant (the same Triton 3.6 numerics)
        ref = ref or got
        ref_ffi = ref_ffi or (got if v != "xla" else None)
        checks[v] = dict(compile_s=time.perf_counter() - t0)
        for tag, r in (("", ref), ("ffi_", ref_ffi)):
            if r is not None:
                checks[v][tag + "token_agreement"] = float(np.mean(got[0] == r[0]))
                checks[v][tag + "k_cache_rel_err"] = float(max(
                    np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)
                    for g, w in zip(got[1:], r[1:])))
        print(f"{v}: compiled in {checks[v]['compile_s']:.1f} s; " + ", ".join(
            f"{k} {val:.3g}" for k, val in checks[v].items() if k != "compile_s"), flush=True)
        for k in kernels.get(v, []):
            print(f"   {k}", flush=True)
    traces = {}
    if args.trace:
        for v in variants:
            traces[v] = trace_stats(loops[v], model.params, fresh(), args.steps, args.timeline)
            print(f"{v}: {traces[v]}", flush=True)
    times = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            best = float("inf")
            for _ in range(args.repeats):
                s = fresh()
                t0 = time.perf_counter()
                jax.block_until_ready(loops[v](model.params, s))
                best = min(best, (time.perf_counter() - t0) / args.steps)
            times[v].append(best * 1e3)
    print(f"\n{args.preset} B={args.batch} ctx={args.prompt_len}, {args.steps} steps, "
          "wall ms/step (best of each round)")
    rows = []
    for v in variants:
        row = dict(variant=v, ms_per_step=times[v], **checks[v], **traces.get(v, {}))
        rows.append(row)
        c = checks[v]
        print(f"  {v:7s} {' '.join(f'{t:.3f}' for t in times[v])}   tokens "
              f"{c['token_agreement']:.0%} (ffi {c.get('ffi_token_agreement', 1):.0%})  K err "
              f"{c['k_cache_rel_err']:.1e} (ffi {c.get('ffi_k_cache_rel_err', 0):.1e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, kernels=kernels), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
