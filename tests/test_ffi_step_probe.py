"""benchmarks/ffi_step_probe.py on the CPU: the PDL instructions land where each mode says and
the IR still verifies in a Triton context; inside `Launcher.install()` every Pallas Triton call
of a lowering becomes one call of our FFI target with the same operands and aliases, and equal
kernels compile once. The Triton compile is replaced by a stand-in here (CI has no Triton); what
the step costs is measured on the H200 (`bash benchmarks/run_h200.sh ffistep`; NOTES.md run O)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax._src.lib.mlir import ir
from jax._src.pallas.triton import lowering as triton_lowering

import benchmarks.ffi_step_probe as probe
import pallas_kernels as pk
from benchmarks.triton_asm import triton_modules
from test_gpu_lowering import H200, TRITON, S

BF16 = jnp.bfloat16


def matmul(x, w):
    return pk.norm_matmul(x, None, w)


def lowered(fn, *args) -> str:
    """fn(*args) lowered for CUDA on an abstract H200 (our FFI target allowed): StableHLO."""
    with jax.sharding.use_abstract_mesh(H200):
        exported = export.export(jax.jit(fn), platforms=("cuda",), disabled_checks=[
            export.DisabledSafetyCheck.custom_call(TRITON),
            export.DisabledSafetyCheck.custom_call(probe.TARGET)])(*args)
    return exported.mlir_module()


@pytest.fixture(scope="module")
def matmul_ir() -> str:
    with triton_modules() as seen:
        lowered(matmul, S((1, 512), BF16), S((512, 512), BF16))
    assert len(seen) == 1
    return seen[0]


def gdc_lines(text: str) -> list[tuple[int, str]]:
    """(line number, "wait" | "trigger") of each PDL instruction, in order."""
    return [(i, "wait" if "griddepcontrol.wait" in ln else "trigger")
            for i, ln in enumerate(text.splitlines()) if "griddepcontrol" in ln]


@pytest.mark.parametrize("mode", sorted(probe.PDL_MODES))
def test_pdl_modes_place_their_instructions(matmul_ir, mode):
    text = probe.with_pdl(matmul_ir, mode)
    lines = text.splitlines()
    head = next(i for i, ln in enumerate(lines) if re.match(r"\s*tt\.func ", ln))
    at_start, late, _ = probe.PDL_MODES[mode]
    got = gdc_lines(text)
    start = [kind for i, kind in got if i <= head + len(at_start)]
    assert start == list(at_start)
    assert all(i == head + 1 + n for n, (i, _) in enumerate(got[:len(at_start)]))
    rest = got[len(at_start):]
    if late:  # one trigger, after the main loop's closing brace and before any store after it
        [(i, kind)] = rest
        loop = next(j for j, ln in enumerate(lines) if " = scf.for " in ln)
        assert kind == "trigger" and i > loop and lines[i - 1].rstrip() == "    }"
    else:
        assert rest == []
    with triton_lowering._new_ir_context():  # still valid Triton IR, as XLA would parse it
        ir.Module.parse(text)


def test_pdl_mode_errors(matmul_ir):
    with pytest.raises(ValueError, match="not one of"):
        probe.with_pdl(matmul_ir, "early")
    with pytest.raises(ValueError, match="no tt.func"):
        probe.with_pdl("module {\n}\n", "wait")
    with pytest.raises(ValueError, match="not one of"):
        probe.Launcher("early", load=None)


@pytest.fixture
def fake_compile(monkeypatch):
    """compile_ttir without Triton: the fields the launcher reads, from the IR's text."""
    compiled = []

    def compile_ttir(ttir, num_warps, num_stages, workdir):
        compiled.append(ttir)
        n_args = re.search(r"tt\.func[^(]*\(([^)]*)\)", ttir).group(1).count("%arg")
        return dict(cubin=b"", entry="k", n_args=n_args, n_ptx_params=n_args + 2,
                    shared=1024, n_regs=0, global_scratch=0, profile_scratch=0,
                    num_warps=num_warps)

    monkeypatch.setattr(probe, "compile_ttir", compile_ttir)
    return compiled


@pytest.mark.parametrize("mode,pdl", [("off", 0), ("wait", 2), ("start1", 2)])
def test_install_replaces_the_pallas_calls(fake_compile, mode, pdl):
    loads = []
    launcher = probe.Launcher(mode, lambda info, shared: loads.append(shared) or len(loads) - 1)

    def two_products(x, w1, w2):  # the same kernel twice
        return matmul(matmul(x, w1), w2)

    args = (S((1, 512), BF16), S((512, 512), BF16), S((512, 512), BF16))
    jax.clear_caches()
    with launcher.install():
        text = lowered(two_products, *args)
    calls = re.findall(r"custom_call @(\S+)\(([^)]*)\)[^\n]*", text)
    assert [c[0] for c in calls] == [probe.TARGET] * 2
    assert TRITON not in text
    assert f"pdl = {pdl} : i64" in text
    assert len(fake_compile) == 1 and len(loads) == 1  # equal kernels: compiled and loaded once
    # one launch each, over every operand and result of the call, on the Pallas grid
    n = len(calls[0][1].split(",")) + 1
    assert f"nparams = dense<{n}>" in text
    assert launcher.kernels[0]["grid"] == [int(g) for g in re.search(
        r"grids = dense<\[(\d+), (\d+), (\d+)\]>", text).groups()]
    grid = launcher.kernels[0]["grid"]
    one_cta = mode == "start1" and grid[0] * grid[1] * grid[2] <= probe.NUM_SMS
    assert loads == [probe.ONE_CTA_SMEM if one_cta else 1024]
    # outside the context, Pallas lowers as before
    jax.clear_caches()
    assert probe.TARGET not in lowered(two_products, *args)


def test_per_kernel_overrides(fake_compile):
    """"late+free@SUBSTR": the named kernels race (no wait), the rest wait at their start."""
    launcher = probe.Launcher("late+free@k512_n512", lambda info, shared: 0)
    jax.clear_caches()
    with launcher.install():
        lowered(matmul, S((1, 512), BF16), S((512, 512), BF16))
    [k] = launcher.kernels
    assert k["mode"] == "free"
    assert "griddepcontrol.wait" not in fake_compile[0]
    assert "griddepcontrol.launch_dependents" in fake_compile[0]
    for bad in ("late+free", "late+early@x", "late+free@"):
        with pytest.raises(ValueError, match="overrides"):
            probe.Launcher(bad, load=None)


def test_cuda_override_replaces_the_o_projection(fake_compile):
    """"cudaR@SUBSTR" swaps pdl_stream_gemv.cu in for the 4096 x 4096 split-2 partials matmul
    (its own grid, three pointers); any other kernel is refused."""
    loads = []
    launcher = probe.Launcher("late+cuda1536@k4096_n4096",
                              lambda info, shared: loads.append((info, shared)) or 7)
    jax.clear_caches()
    with launcher.install():
        text = lowered(lambda a, w: pk.norm_matmul(a, None, w, partials=True),
                       S((1, 4096), BF16), S((4096, 4096), BF16))
    assert fake_compile == []  # no Triton compile for the replaced kernel
    assert loads == [(probe.stream_gemv_spec("cuda1536"), 1536 * 128 + 4096)]
    assert probe.stream_gemv_spec("cuda1536")["threads"] == 256
    assert "kernels = dense<7>" in text and "grids = dense<[64, 2, 1]>" in text
    launcher = probe.Launcher("late+cuda1536@k512", lambda info, shared: 0)
    jax.clear_caches()
    with pytest.raises(ValueError, match="replaces only"), launcher.install():
        lowered(matmul, S((1, 512), BF16), S((512, 512), BF16))


def test_stream_gemv_spec():
    spec = probe.stream_gemv_spec("cuda1536x62")  # 124 blocks of 8-9 vectors: 288 threads
    assert spec["grid"] == (62, 2, 1) and spec["threads"] == 288
    assert spec["shared"] == 1536 * 9 * 16 + 4096 and "-DNBLK=62" in spec["defines"]
    assert probe.stream_gemv_spec("cuda0")["shared"] == 32 * 8 * 8 * 4 + 4096
    for bad in ("cuda", "cuda2049", "cuda1536x16", "cuda2048"):
        with pytest.raises(ValueError):
            probe.stream_gemv_spec(bad)
