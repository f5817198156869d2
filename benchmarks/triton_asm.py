"""The decode kernels' Triton IR, and what upstream Triton compiles it to, on a CPU.

    # 1. in the project's environment: lower the kernels for an H200 and write their Triton IR
    PYTHONPATH=. python3 benchmarks/triton_asm.py dump DIR
    # 2. in an environment with `pip install triton` (no GPU needed): TTGIR, PTX, ptxas -v
    python3 benchmarks/triton_asm.py compile DIR

Step 1 lowers, at Llama-3-8B batch-1 decode shapes, the kernels of a decode layer (q/k/v
projection, decode attention, o projection, SwiGLU, down projection, and the one-kernel MLP
swiglu_down), as
`tests/test_gpu_lowering.py` does
(jax.export for CUDA; no GPU), and writes each Pallas Triton module as DIR/NAME.ttir with its
num_warps / num_stages. Step 2 compiles each with upstream Triton for sm_90a and prints what
tells a pipelined, vectorized, spill-free loop from one that is not: registers and spill bytes
(ptxas -v), async copies (cp.async), vector widths of the global loads, local-memory traffic.
Upstream Triton's pipeline is close to, not the same as, the one XLA runs (jaxlib bundles its
own), so the figures guide a diagnosis; the H200 has the last word.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys


@contextlib.contextmanager
def triton_modules():
    """Collects, as text, every Triton module Pallas lowers inside the `with` (the IR XLA
    receives in its Triton custom calls)."""
    from pallas_kernels._jax_private import triton_lowering

    real = triton_lowering.lower_jaxpr_to_triton_module
    seen = []

    def capture(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append(str(result.module))
        return result

    triton_lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield seen
    finally:
        triton_lowering.lower_jaxpr_to_triton_module = real


def dump(out: str, slots: int = 384) -> None:
    os.makedirs(out, exist_ok=True)
    with triton_modules() as seen:
        _lower_decode_kernels(out, slots, seen)


def _lower_decode_kernels(out: str, slots: int, seen: list) -> None:
    """dump's body: lowers the decode kernels; `seen` collects their Triton modules."""
    import jax
    import jax.numpy as jnp
    from jax import export

    from pallas_kernels.decode_attention_append import decode_attention_append
    from pallas_kernels.norm_matmul import norm_matmul
    from pallas_kernels.swiglu import swiglu, swiglu_down

    b, s, k, hkv, g, d = 1, slots, 4096, 8, 4, 128
    S = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    x, nw = S((b, k), bf), S((k,), bf)
    w = S((k, hkv, g + 2, d), bf)
    kc = S((b, s, hkv, d), bf)
    pos = S((b,), i32)
    cs = S((b, d), f32)
    deltas = S((2, b, k), f32)

    def qkv_attention(x, nw, w, kc, vc, pos, deltas, cos, sin):
        x2, (parts, ss) = norm_matmul(x, nw, w, eps=1e-5, partials=True, deltas=deltas)
        return decode_attention_append(parts, kc, vc, pos, rope=(cos, sin), norm=(ss, k, 1e-5))

    def o_mlp(attn, x, nw, wo, wg, wu, wd):
        o_parts = norm_matmul(attn, None, wo, partials=True)  # [S, 1, D] float32
        x2, h = swiglu(x, wg, wu, norm_weight=nw, eps=1e-5, deltas=o_parts)
        return x2, norm_matmul(h, None, wd, partials=True)

    def o_mlp1(attn, x, nw, wo, wg, wu, wd, acc, clear):  # the one-kernel MLP
        o_parts = norm_matmul(attn, None, wo, partials=True)
        return swiglu_down(x, wg, wu, wd, acc, clear, norm_weight=nw, eps=1e-5, deltas=o_parts)

    f = 14336
    mlp_args = (x, x, nw, S((k, k), bf), S((k, f), bf), S((k, f), bf), S((f, k), bf))
    acc = S((b, k), f32)

    from jax.sharding import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=132, platform="gpu"))
    for name, fn, args in (("decode", qkv_attention, (x, nw, w, kc, kc, pos, deltas, cs, cs)),
                           ("mlp", o_mlp, mlp_args), ("mlp1", o_mlp1, (*mlp_args, acc, acc))):
        start = len(seen)
        with jax.sharding.use_abstract_mesh(mesh):
            exported = export.export(
                jax.jit(fn), platforms=("cuda",),
                disabled_checks=[export.DisabledSafetyCheck.custom_call(
                    "__gpu$xla.gpu.triton")])(*args)
        hlo = exported.mlir_module()
        # num_warps / num_stages of each call, in call order
        cfgs = [(re.search(r"num_warps = (\d+)", ln).group(1),
                 re.search(r"num_stages = (\d+)", ln).group(1))
                for ln in hlo.splitlines() if "xla.gpu.triton" in ln and "num_warps" in ln]
        for i, text in enumerate(seen[start:]):
            kname = re.search(r"tt\.func (?:public )?@(\w+)", text).group(1)
            path = os.path.join(out, f"{name}{i}_{kname}"[:80] + ".ttir")
            with open(path, "w") as f:
                f.write(text)
            meta = dict(zip(("num_warps", "num_stages"),
                            map(int, cfgs[i]))) if i < len(cfgs) else {}
            with open(path + ".json", "w") as f:
                json.dump(meta, f)
            print(path, meta)


def compile_all(out: str) -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for name in sorted(os.listdir(out)):
        if not name.endswith(".ttir"):
            continue
        path = os.path.join(out, name)
        meta = json.load(open(path + ".json")) if os.path.exists(path + ".json") else {}
        meta.setdefault("num_warps", 4)
        meta.setdefault("num_stages", 3)
        try:
            kernel = triton.compile(path, target=target, options=meta)
        except Exception as e:  # an IR this Triton cannot parse: say so and go on
            print(f"== {name}: {type(e).__name__}: {str(e)[:600]}")
            continue
        stem = path[:-5]
        for stage in ("ttgir", "llir", "ptx"):
            with open(f"{stem}.{stage}", "w") as f:
                f.write(kernel.asm[stage])
        ptx = kernel.asm["ptx"]
        counts = {c: len(re.findall(rx, ptx)) for c, rx in {
            "cp.async": r"cp\.async\.c[ag]", "cp.async.bulk": r"cp\.async\.bulk",
            "ld.global.v4": r"ld\.global[.\w]*\.v4", "ld.global.v2": r"ld\.global[.\w]*\.v2",
            "ld.global (all)": r"ld\.global", "ld.local": r"ld\.local", "st.local": r"st\.local",
            "mma": r"mma\.sync|wgmma\.mma_async", "bar.sync": r"bar\.sync"}.items()}
        r = subprocess.run([ptxas, "-v", "-arch=sm_90a", f"{stem}.ptx", "-o", f"{stem}.cubin"],
                           capture_output=True, text=True)
        usage = " ".join(ln.strip() for ln in (r.stdout + r.stderr).splitlines()
                         if re.search(r"registers|spill|rror", ln))
        print(f"== {name} {meta}\n   {counts}\n   {usage}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "compile"):
        sys.exit("usage: triton_asm.py dump DIR | triton_asm.py compile DIR")
    if sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif not os.path.isdir(sys.argv[2]):
        sys.exit(f"triton_asm.py compile: no directory {sys.argv[2]} (run `dump` first)")
    else:
        compile_all(sys.argv[2])
