"""Every private JAX module the project uses, in one place, for the pinned jax.

The relaxed atomic (atomics.py) and the L2 prefetch (l2_prefetch.py) are new primitives with
Triton lowerings, which JAX has no public API for; they reach into these modules.
`tests/test_jax_private.py` fails when the installed jax is not `PINNED_JAX` or a name used
here has moved: an upgrade re-checks these uses first (and only these).
"""

from __future__ import annotations

import jax
from jax._src import core as jax_core  # noqa: F401  (Primitive)
from jax._src import effects  # noqa: F401
from jax._src import tree_util  # noqa: F401
from jax._src.interpreters import mlir  # noqa: F401
from jax._src.lib.triton import dialect as tt_dialect  # noqa: F401
from jax._src.pallas import core as pallas_core  # noqa: F401
from jax._src.pallas import primitives as pallas_primitives  # noqa: F401
from jax._src.pallas.triton import lowering as triton_lowering  # noqa: F401
from jax._src.pallas.triton import primitives as triton_primitives  # noqa: F401
from jax._src.state import discharge as state_discharge  # noqa: F401
from jax._src.state import indexing  # noqa: F401
from jax._src.state import primitives as state_primitives  # noqa: F401
from jax._src.state import types as state_types  # noqa: F401

PINNED_JAX = "0.11.2"

# The private names the kernels use (module, attribute), checked by the test.
USED = (
    ("pallas_primitives", "_swap_abstract_eval"),
    ("triton_primitives", "_atomic_rmw_discharge_rule"),
    ("triton_primitives", "AtomicOpType"),
    ("triton_lowering", "register_lowering"),
    ("triton_lowering", "_compute_pointers_from_indices"),
    ("triton_lowering", "_ensure_ir_value"),
    ("triton_lowering", "_atomic_rmw"),
    ("triton_lowering", "_add"),
    ("triton_lowering", "_bcast_to"),
    ("triton_lowering", "ir"),
    ("triton_lowering", "lower_jaxpr_to_triton_module"),
    ("tt_dialect", "RMWOp"),
    ("tt_dialect", "MemSemantic"),
    ("tt_dialect", "elementwise_inline_asm"),
    ("state_discharge", "register_discharge_rule"),
    ("state_primitives", "get_ref_and_transforms"),
    ("state_types", "transform_type"),
    ("indexing", "NDIndexer"),
    ("effects", "control_flow_allowed_effects"),
    ("pallas_core", "kernel_local_effects"),
    ("jax_core", "Primitive"),
    ("tree_util", "tree_flatten"),
)


def is_tracer(x) -> bool:
    """Whether x is a traced value (its contents unknown until run)."""
    return isinstance(x, jax.core.Tracer)
