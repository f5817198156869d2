"""Is a hand-written Triton GEMV faster than the same GEMV written in Pallas when *XLA* compiles
and launches both?

    PYTHONPATH=. python3 benchmarks/ttir_inject_probe.py [--dim 4096] [--layers 16] [--json F]

Why: run J (benchmarks/NOTES.md) compiled two GEMVs with upstream Triton 3.6 and launched them
from our own FFI call: the Triton-source kernel (`pdl_launch_probe.gemv_kernel`) ran a
4096 x 4096 product in 12.69 us, the Pallas kernel of the same tiles (`pdl_probe.
triton_pdl_gemv`) in 13.90-14.06, and XLA's own compile and launch of that Pallas kernel in
13.23. Their loops match op for op; what differs is the IR around them (address arithmetic, how
x reaches the dot). If XLA, too, compiles the Triton-source IR faster, the decode matmuls lose
~0.5-1 us each to the form of the IR Pallas emits, and the fix is in how our kernels are
written, not in the launch path.

How: the Triton-source kernel is compiled by the machine's Triton only as far as its Triton IR
(`kernel.asm["ttir"]`). A pallas_call of the same signature (x [K] flat, w [K, N], out [N]) is
lowered as usual, but its Triton module is swapped for that IR (parsed into the lowering's
context, the function renamed) before Pallas serializes it, so XLA compiles and launches the
hand-written kernel exactly as it does ours. The chain (16 products x [1, D] @ w_l [D, D],
`chain_timing.measure_all`, checked against jnp) then runs:
  - xla: jnp.dot per product;
  - pallas BODY: pdl_probe.triton_pdl_gemv (layout "flat", no PDL instructions);
  - source BODY: the same pallas_call carrying the Triton-source IR;
  - FORM BODY: either IR with one of its differences moved to the other side (the dot
    accumulating or started from zeros, the loop stepping k or an index: the rewrites below);
  - norm_matmul: the model's decode matmul (split-K, with an XLA sum per product).
`--production FORM` times only the norm_matmul chain, with its own Triton IR or a Triton-source
kernel of the same signature swapped in.
BODY = block_n x block_k x stages. Needs an NVIDIA GPU and Triton (torch's); nothing here is
used by the engine.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys

import jax
import jax.numpy as jnp

from benchmarks.chain_timing import finish, measure_all
from benchmarks.pdl_probe import chain, triton_pdl_gemv, variants
from benchmarks.triton_asm import triton_modules


def source_ttir(block_n: int, block_k: int, stages: int, dim: int) -> str:
    """The Triton IR of pdl_launch_probe.gemv_kernel (no PDL instructions)."""
    from benchmarks.pdl_launch_probe import gemv_kernel

    return compiled_ttir(gemv_kernel, dict(K=dim, N=dim, BLOCK_N=block_n, BLOCK_K=block_k,
                                           TRIGGER=0, WAIT=0), "*bf16", stages)


def compiled_ttir(kernel, consts: dict, out_type: str, stages: int) -> str:
    """The Triton IR of a Triton-source kernel (x_ptr bf16, w_ptr bf16, o_ptr `out_type`, then
    the constexprs `consts`), from the machine's Triton for sm_90 (4 warps), its location info
    stripped. The pointers are marked 16-byte aligned, as Triton's launcher would."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(x_ptr="*bf16", w_ptr="*bf16", o_ptr=out_type, **{c: "constexpr" for c in consts})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts,
                                        attrs=aligned),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=stages))
    return strip_locations(compiled.asm["ttir"])


def strip_locations(ttir: str) -> str:
    """The IR without `loc(...)` annotations and #loc aliases (the text parses the same)."""
    lines = [ln for ln in ttir.splitlines() if not ln.startswith("#loc")]
    text = "\n".join(lines)
    # nested parentheses: loc("x"(#loc)) or loc(callsite(#loc3 at #loc57)); strip innermost-out
    pattern = re.compile(r"\s*loc\((?:[^()]|\([^()]*(?:\([^()]*\))*[^()]*\))*\)")
    return pattern.sub("", text)


def install_swaps(swaps: dict[str, str]):
    """From now on, the Pallas Triton lowering of a kernel named NAME returns swaps[NAME] (its
    function renamed to the kernel's) instead of its own module. Lowering runs when jit
    compiles, after tracing, so the swap is keyed by name rather than scoped. Returns the
    lowering function it replaced (to put back)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    real = triton_lowering.lower_jaxpr_to_triton_module

    def swap(*args, **kwargs):
        result = real(*args, **kwargs)
        name = re.search(r"tt\.func (?:public )?@(\w+)", str(result.module)).group(1)
        if name not in swaps:
            return result
        text = re.sub(r"tt\.func (public )?@\w+", rf"tt.func \1@{name}", swaps[name], count=1)
        with result.module.context:
            module = ir.Module.parse(text)
        return triton_lowering.LoweringResult(module, result.grid)

    triton_lowering.lower_jaxpr_to_triton_module = swap
    return real


def dot_accumulates(ttir: str) -> str:
    """Pallas' loop body `d = tt.dot a, b, zeros; r = arith.addf acc, d; scf.yield r` as the
    accumulating form Triton source writes: `d = tt.dot a, b, acc; scf.yield d`."""
    pattern = re.compile(r"(%\w+) = tt\.dot (%\w+), (%\w+), %\w+([^\n]*)\n(\s*)(%\w+) = "
                         r"arith\.addf (%\w+), \1 : [^\n]+\n\s*scf\.yield \6")
    out, n = pattern.subn(lambda m: f"{m[1]} = tt.dot {m[2]}, {m[3]}, {m[7]}{m[4]}\n"
                                    f"{m[5]}scf.yield {m[1]}", ttir)
    assert n == 1, f"expected one accumulating dot, found {n}"
    return out


def dot_then_add(ttir: str) -> str:
    """The inverse of dot_accumulates on Triton-source IR: the dot starts from zeros and its
    result is added to the accumulator (Pallas' form)."""
    pattern = re.compile(r"(%\w+) = tt\.dot (%\w+), (%\w+), (%\w+)([^\n]*-> (tensor<[^>]+>))"
                         r"\n(\s*)scf\.yield \1")
    out, n = pattern.subn(
        lambda m: f"%zacc = arith.constant dense<0.000000e+00> : {m[6]}\n"
                  f"{m[7]}%dz = tt.dot {m[2]}, {m[3]}, %zacc{m[5]}\n"
                  f"{m[7]}{m[1]} = arith.addf {m[4]}, %dz : {m[6]}\n{m[7]}scf.yield {m[1]}", ttir)
    assert n == 1, f"expected one accumulating dot, found {n}"
    return out


def index_loop(ttir: str) -> str:
    """Triton-source IR whose loop runs k = lo, lo + step, ... < hi as Pallas' does: over an
    index i = 0, 1, ... with k = lo + i * step (marked divisible by a constant step)."""
    pattern = re.compile(r"(%[\w:]+) = scf\.for (%\w+) = (%\w+) to (%\w+) step (%\w+) "
                         r"(iter_args\([^\n]*\{)\n(\s*)")
    m = pattern.search(ttir)
    assert m, "no scf.for"
    result, k, lo, hi, step, rest, body = m.groups()
    line_start = ttir.rfind("\n", 0, m.start()) + 1
    indent = ttir[line_start:m.start()]
    const = re.search(rf"{re.escape(step)} = arith\.constant (\d+) : i32", ttir)
    hint = f" {{tt.divisibility = dense<{const[1]}> : tensor<1xi32>}}" if const else ""
    head = (f"%one_ix = arith.constant 1 : i32\n{indent}%zero_ix = arith.constant 0 : i32\n"
            f"{indent}%span_ix = arith.subi {hi}, {lo} : i32\n"
            f"{indent}%room_ix = arith.addi %span_ix, {step} : i32\n"
            f"{indent}%room1_ix = arith.subi %room_ix, %one_ix : i32\n"
            f"{indent}%iters_ix = arith.divsi %room1_ix, {step} : i32\n"  # ceil(span / step)
            f"{indent}{result} = scf.for %i_ix = %zero_ix to %iters_ix step %one_ix {rest}\n"
            f"{body}%off_ix = arith.muli %i_ix, {step}{hint} : i32\n"
            f"{body}{k} = arith.addi {lo}, %off_ix : i32\n{body}")
    return ttir[:m.start()] + head + ttir[m.end():]


def offset_loops(ttir: str) -> str:
    """Every `scf.for %i = lo to hi step 1` whose body computes `%m = arith.muli %i, %cC` (C a
    constant: Pallas' `fori_loop` over tiles, start = i * C) as the loop Triton source writes:
    `scf.for %k = lo * C to hi * C step C`, with %m = %k and %i = %k / C (when still used)."""
    header = re.compile(r"(%[\w:]+) = scf\.for (%\w+) = (%\w+) to (%\w+) step (%\w+) ")
    out, pos, n = [], 0, 0
    for m in header.finditer(ttir):
        iv, lo, hi, step = m[2], m[3], m[4], m[5]
        if not re.search(rf"{re.escape(step)} = arith\.constant 1 : i32", ttir):
            continue
        mul = re.compile(rf"(%\w+) = arith\.muli {re.escape(iv)}, (%\w+)( \{{[^}}]*\}})? : i32")
        use = mul.search(ttir, m.end())
        if use is None:
            continue
        const = re.search(rf"{re.escape(use[2])} = arith\.constant (\d+) : i32", ttir)
        if const is None:
            continue
        c, tag = int(const[1]), f"_ofs{n}"
        line_start = ttir.rfind("\n", 0, m.start()) + 1
        indent = ttir[line_start:m.start()]
        body_indent = indent + "  "
        pre = (f"%c{tag} = arith.constant {c} : i32\n{indent}"
               f"%zero{tag} = arith.constant 0 : i32\n{indent}"
               f"%lo{tag} = arith.muli {lo}, %c{tag} : i32\n{indent}"
               f"%hi{tag} = arith.muli {hi}, %c{tag} : i32\n{indent}")
        head_end = ttir.index("\n", m.end()) + 1  # after `... {`
        new_head = (ttir[m.start():m.end()].replace(
            f"{iv} = {lo} to {hi} step {step}", f"%k{tag} = %lo{tag} to %hi{tag} step %c{tag}")
            + ttir[m.end():head_end]
            + f"{body_indent}{iv} = arith.divsi %k{tag}, %c{tag} : i32\n")
        offset = f"{use[1]} = arith.addi %k{tag}, %zero{tag}{use[3] or ''} : i32"
        out += [ttir[pos:m.start()], pre, new_head, ttir[head_end:use.start()], offset]
        pos = use.end()
        n += 1
    out.append(ttir[pos:])
    return "".join(out)


def install_rewrite(rewrite, only: list[str] | None = None):
    """From now on every Pallas Triton module (or those whose kernel name holds one of `only`)
    is lowered as usual, then replaced by rewrite(its text, locations stripped), parsed back
    into its context. Returns the lowering function it replaced (to put back)."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    real = triton_lowering.lower_jaxpr_to_triton_module

    def swap(*args, **kwargs):
        result = real(*args, **kwargs)
        text = strip_locations(str(result.module))
        name = re.search(r"tt\.func (?:public )?@(\w+)", text).group(1)
        if only is not None and not any(o in name for o in only):
            return result
        text = rewrite(text)
        with result.module.context:
            module = ir.Module.parse(text)
        return triton_lowering.LoweringResult(module, result.grid)

    triton_lowering.lower_jaxpr_to_triton_module = swap
    return real


REWRITES = {"offset-loops": offset_loops}


def production_source_ttir(form: str, k: int, n: int, block_n: int, block_k: int, split: int,
                           stages: int) -> str:
    """Triton-source IR with the signature and grid of norm_matmul's plain decode matmul
    (`matmul_none_k{K}_n{N}_split{S}`: x [1, K] bf16, w [K, N] bf16, out [S, 1, N] float32 of
    split-K partials; program (0, N tile, K chunk)). form "bcast": x loaded as [block_k] and
    broadcast to the dot's 16 rows (a hand-written GEMV); "masked": x loaded as a [16, block_k]
    block of which rows >= 1 are masked (how norm_matmul reads it)."""
    from benchmarks.pdl_launch_probe import split_gemv_kernel

    return compiled_ttir(split_gemv_kernel,
                         dict(K=k, N=n, KC=k // split, BLOCK_N=block_n, BLOCK_K=block_k,
                              MASKED=form == "masked"), "*fp32", stages)


def chain_inputs(d: int, layers: int):
    """x [1, D] bf16, `layers` weights [D, D] (scaled so that activations keep their size) and
    the chain's result by XLA's dot (what every variant is checked against)."""
    keys = jax.random.split(jax.random.key(d), layers + 1)
    x = jax.random.normal(keys[0], (1, d), jnp.float32).astype(jnp.bfloat16)
    weights = [(jax.random.normal(k, (d, d), jnp.float32) / d ** 0.5).astype(jnp.bfloat16)
               for k in keys[1:]]
    return x, weights, jax.jit(functools.partial(chain, variants([], ())["xla"]))(x, weights)


def production_case(form: str, d: int, layers: int, repeats: int, json_path: str | None) -> int:
    """The chain through norm_matmul (x [1, D] @ [D, D]: 64 x 256 tiles, 3 stages, split 2),
    its Pallas IR kept ("pallas") or swapped for production_source_ttir(form)."""
    import pallas_kernels as pk

    x, weights, want = chain_inputs(d, layers)
    if form != "pallas":
        install_swaps({f"matmul_none_k{d}_n{d}_split2":
                       production_source_ttir(form, d, d, 64, 256, 2, 3)})
    matmul = lambda x, w: pk.norm_matmul(x, None, w)  # noqa: E731
    rows, failures = measure_all([(f"norm_matmul {form}", functools.partial(chain, matmul), x,
                                   False)], weights, want, dim=d, layers=layers,
                                 repeats=repeats, unroll=True)
    return finish(rows, failures, json_path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--blocks", default="64x256x3,32x256x8",
                   help="block_n x block_k x stages")
    p.add_argument("--dump", default=None, help="write each Triton-source IR to DUMP_BODY.ttir")
    p.add_argument("--production", default=None, choices=("pallas", "bcast", "masked"),
                   help="only the chain through norm_matmul, its Triton IR kept or swapped for "
                        "a Triton-source kernel of that form (one form per process: the swap "
                        "is keyed by the kernel's name)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("ttir_inject_probe: needs an NVIDIA GPU", file=sys.stderr)
        return 1
    d, layers = args.dim, args.layers
    if args.production:
        return production_case(args.production, d, layers, args.repeats, args.json)
    x, weights, want = chain_inputs(d, layers)
    impls = variants([], ())
    cases = [("xla dot", functools.partial(chain, impls["xla"]), x, False),
             ("norm_matmul", functools.partial(chain, impls["triton"]), x, False)]
    swaps = {}
    for blocks in args.blocks.split(","):
        bn, bk, st = (int(v) for v in blocks.split("x"))
        gemv = functools.partial(triton_pdl_gemv, mode="plain", layout="flat", block_n=bn,
                                 block_k=bk, stages=st)
        with triton_modules() as seen:
            jax.jit(gemv).lower(x, weights[0])
        pallas_ir = strip_locations(seen[0])
        source_ir = source_ttir(bn, bk, st, d)
        forms = {"source": source_ir,
                 "pallas, dot accumulating": dot_accumulates(pallas_ir),
                 "source, dot then add": dot_then_add(source_ir),
                 "source, index loop": index_loop(source_ir),
                 "pallas, offset loop": offset_loops(pallas_ir)}
        cases.append((f"pallas {blocks}", functools.partial(chain, gemv), x, False))
        for i, (form, ir_text) in enumerate(forms.items()):
            name = f"ttir_{i}_{bn}x{bk}x{st}"
            swaps[name] = ir_text
            if args.dump:
                with open(f"{args.dump}_{name}.ttir", "w") as f:
                    f.write(ir_text)
            cases.append((f"{form} {blocks}",
                          functools.partial(chain, functools.partial(gemv, name=name)), x, False))
    install_swaps(swaps)
    rows, failures = measure_all(cases, weights, want, dim=d, layers=layers,
                                 repeats=args.repeats, unroll=True)
    return finish(rows, failures, args.json)


if __name__ == "__main__":
    sys.exit(main())
