"""Programmatic dependent launch (PDL) instructions for Pallas Triton kernels.

    gdc_launch_dependents()   this program lets the next kernel in the stream start launching
    gdc_wait()                block until every kernel this one depends on has finished and its
                              writes are visible
    gdc_wait_token()          the same wait, returning an int32 0 that loads can take into
                              their address, so that they cannot move above the wait (Triton
                              then neither vectorizes nor pipelines them: 18.7 against 11.8 us
                              per 33.5 MB GEMV, benchmarks/NOTES.md run J)

On Hopper, a kernel launched with PDL may start while its predecessor is still running: its
programs take the SMs the predecessor frees, do what needs none of the predecessor's results
(stream a weight that no kernel writes) and wait (`griddepcontrol.wait`) only before the first
read of a result. Without PDL (an older GPU, a launch without the attribute) the wait returns at
once. The decode step is a chain of such kernels, each losing ~2.5 us to its ramp and tail
(benchmarks/NOTES.md); these primitives are how a kernel says where its independent prefix ends.

XLA (jax 0.11.2) launches Pallas kernels without the PDL attribute, so under pallas_call these
change nothing but a little time; benchmarks/pdl_ffi_probe.py launches kernels that hold them
with PDL (NOTES.md run J). Triton's pipeliner hoists a loop's pipelined loads above a wait
inside that loop: wait before the loop, or the loads race.

Lowering: `tt.grid_dependency_wait` / `tt.grid_dependency_launch_dependents` (jaxlib's Triton
dialect; the ops XLA's Triton pipeline lowers to `griddepcontrol`), and for the token a
non-pure inline asm. In interpret mode (CPU) they do nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src import effects
from jax._src.interpreters import mlir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import lowering as triton_lowering


class PdlEffect(effects.Effect):
    """Keeps the instructions in place: they have no outputs that anything uses."""


pdl_effect = PdlEffect()
effects.control_flow_allowed_effects.add_type(PdlEffect)
pallas_core.kernel_local_effects.add_type(PdlEffect)


def _effect_primitive(name):
    p = jax_core.Primitive(name)
    p.multiple_results = True
    p.def_effectful_abstract_eval(lambda: ((), {pdl_effect}))
    p.def_impl(lambda: [])  # interpret mode: nothing to wait for
    mlir.register_lowering(p, lambda ctx: [])
    return p


gdc_wait_p = _effect_primitive("gdc_wait")
gdc_launch_dependents_p = _effect_primitive("gdc_launch_dependents")


@triton_lowering.register_lowering(gdc_wait_p)
def _gdc_wait_lowering(ctx):
    del ctx
    tt_dialect.grid_dependency_wait()
    return []


@triton_lowering.register_lowering(gdc_launch_dependents_p)
def _gdc_launch_dependents_lowering(ctx):
    del ctx
    tt_dialect.grid_dependency_launch_dependents()
    return []


gdc_wait_token_p = jax_core.Primitive("gdc_wait_token")


@gdc_wait_token_p.def_effectful_abstract_eval
def _gdc_wait_token_abstract_eval():
    return jax_core.ShapedArray((), jnp.int32), {pdl_effect}


gdc_wait_token_p.def_impl(lambda: jnp.int32(0))
mlir.register_lowering(gdc_wait_token_p, lambda ctx: [mlir.ir_constant(np.int32(0))])


@triton_lowering.register_lowering(gdc_wait_token_p)
def _gdc_wait_token_lowering(ctx):
    i32 = triton_lowering._dtype_to_ir_type(jnp.int32)  # the scalar i32, not a tensor
    return tt_dialect.elementwise_inline_asm(
        [i32], "griddepcontrol.wait; mov.u32 $0, 0;", constraints="=r", pure=False,
        packed_element=1, args=[])


def gdc_wait() -> None:
    """Wait for the kernels this one depends on (a no-op without PDL)."""
    gdc_wait_p.bind()


def gdc_launch_dependents() -> None:
    """Let the next kernel launch (its programs run up to their own wait)."""
    gdc_launch_dependents_p.bind()


def gdc_wait_token():
    """gdc_wait() returning int32 0: add it to a load's index to keep the load after it."""
    return gdc_wait_token_p.bind()
