"""benchmarks/ttir_inject_probe.py (Triton IR swapped into a pallas_call, and rewrites of
Pallas' Triton IR) on the CPU: each rewrite changes what it says and nothing else, its result
passes the MLIR verifier in a Triton context (as XLA parses it), and the lowering hooks replace
exactly the modules they name. What the rewritten kernels cost is measured on the H200
(`bash benchmarks/run_h200.sh inject`; benchmarks/NOTES.md, run N)."""

from __future__ import annotations

import functools
import re

import jax.numpy as jnp
import pytest
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering

import benchmarks.ttir_inject_probe as probe
import pallas_kernels as pk
from benchmarks.pdl_probe import triton_pdl_gemv
from benchmarks.triton_asm import triton_modules
from test_gpu_lowering import S, lower_for_h200

BF16 = jnp.bfloat16
GEMV = functools.partial(triton_pdl_gemv, mode="plain", layout="flat", block_n=64, block_k=256,
                         stages=3)


def pallas_ir(fn, *args) -> str:
    """The Triton IR (locations stripped) of the one pallas_call in fn, lowered for an H200."""
    with triton_modules() as seen:
        lower_for_h200(fn, *args)
    assert len(seen) == 1
    return probe.strip_locations(seen[0])


def verified(text: str) -> str:
    """text parsed (and so verified) in a Triton context, printed back."""
    with triton_lowering._new_ir_context():
        return str(ir.Module.parse(text))


@pytest.fixture(scope="module")
def gemv_ir() -> str:
    return pallas_ir(GEMV, S((1, 512), BF16), S((512, 512), BF16))


@pytest.fixture(autouse=True)
def restore_lowering(monkeypatch):
    """Puts Pallas' Triton lowering back after each test (the hooks replace it)."""
    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module",
                        triton_lowering.lower_jaxpr_to_triton_module)


def loop_header(text: str) -> re.Match:
    m = re.search(r"scf\.for (%\w+) = (%\w+) to (%\w+) step (%\w+) ", text)
    assert m, "no scf.for"
    return m


def steps_by_tile(text: str) -> bool:
    """Whether the module's loop steps by 256 (offset_loops' form) rather than by 1."""
    step = loop_header(text)[4]
    return bool(re.search(rf"{re.escape(step)} = arith\.constant 256 : i32", text))


def test_strip_locations(gemv_ir):
    assert "loc(" not in gemv_ir and "#loc" not in gemv_ir
    assert verified(gemv_ir)
    assert probe.strip_locations('%0 = arith.constant 1 : i32 loc(callsite(#loc3 at "f"(#loc)))'
                                 ) == "%0 = arith.constant 1 : i32"


def test_offset_loops(gemv_ir):
    """Pallas' `for i in 0..n step 1 {k = i * 256}` becomes `for k in 0..n*256 step 256`."""
    got = verified(probe.offset_loops(gemv_ir))
    iv, _, _, step = loop_header(got).groups()
    assert re.search(rf"{re.escape(step)} = arith\.constant 256 : i32", got)
    assert not re.search(rf"arith\.muli {re.escape(iv)}, ", got)
    assert gemv_ir.count("tt.dot") == got.count("tt.dot") == 1
    # A loop that already steps by its tile (its step is not the constant 1) stays as it is.
    assert probe.offset_loops(got) == got


def test_offset_loops_on_the_decode_kernels():
    """Every loop of the model's decode matmul and attention kernels takes the rewrite."""
    x, w = S((1, 1024), BF16), S((1024, 1024), BF16)
    text = pallas_ir(lambda x, w: pk.norm_matmul(x, None, w), x, w)
    got = verified(probe.offset_loops(text))
    iv, _, _, step = loop_header(got).groups()
    assert re.search(rf"{re.escape(step)} = arith\.constant 256 : i32", got)
    assert not re.search(rf"arith\.muli {re.escape(iv)}, ", got)


def test_dot_forms(gemv_ir):
    """dot_accumulates folds Pallas' zero-started dot + add into the dot; dot_then_add is its
    inverse (on the accumulating form, as Triton source writes it)."""
    acc = verified(probe.dot_accumulates(gemv_ir))
    assert not re.search(r"arith\.addf %arg\d+, %\d+ : tensor<16x64xf32>", acc)
    dot = re.search(r"tt\.dot (%\w+), (%\w+), (%\w+)\b", acc)
    assert dot[3].startswith("%arg")  # the loop's carried accumulator
    back = verified(probe.dot_then_add(acc))
    assert not re.search(r"tt\.dot %\w+, %\w+, %arg\d+", back)
    assert re.search(r"arith\.addf %arg\d+, %\w+ : tensor<16x64xf32>", back)
    with pytest.raises(AssertionError, match="accumulating dot"):
        probe.dot_accumulates(acc)


def test_index_loop(gemv_ir):
    """Triton source's `for k in lo..hi step 256` as Pallas writes it, over an index."""
    source_form = verified(probe.offset_loops(gemv_ir))
    got = verified(probe.index_loop(probe.strip_locations(source_form)))
    _, lo, _, step = loop_header(got).groups()
    assert re.search(rf"{re.escape(step)} = arith\.constant 1 : i32", got)
    assert re.search(r"arith\.muli %\w+, %\w+ \{tt\.divisibility = dense<256>", got)


def test_swaps_replace_only_the_named_kernel(gemv_ir):
    """install_swaps hands XLA the given IR for the kernel of that name, and leaves the others."""
    real = probe.install_swaps({"swapped_gemv": probe.offset_loops(gemv_ir)})
    assert real is not triton_lowering.lower_jaxpr_to_triton_module  # the one it replaced
    args = (S((1, 512), BF16), S((512, 512), BF16))
    with triton_modules() as calls:  # what the hooked lowering returns, as text
        lower_for_h200(functools.partial(GEMV, name="swapped_gemv"), *args)
        lower_for_h200(functools.partial(GEMV, name="kept_gemv"), *args)
    assert "@swapped_gemv" in calls[0] and "@kept_gemv" in calls[1]
    assert steps_by_tile(calls[0]) and not steps_by_tile(calls[1])


def test_rewrite_filter(gemv_ir):
    """install_rewrite(only=...) rewrites the kernels whose name holds one of the strings."""
    probe.install_rewrite(probe.offset_loops, only=["rewritten"])
    args = (S((1, 512), BF16), S((512, 512), BF16))
    with triton_modules() as seen:
        lower_for_h200(functools.partial(GEMV, name="gemv_rewritten"), *args)
        lower_for_h200(functools.partial(GEMV, name="gemv_plain"), *args)
    assert steps_by_tile(seen[0]) and not steps_by_tile(seen[1])
