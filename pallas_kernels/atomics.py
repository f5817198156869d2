"""A relaxed float32 atomic add for Pallas Triton kernels.

    atomic_add_relaxed(ref, idx, val, mask=None)   ref[idx] += val, atomically, no ordering

Why: Pallas' `atomic_add` lowers to Triton atomics with acquire-release semantics at GPU
scope (jax 0.11.2), an ordering point per instruction. In a loop that streams weights and adds
each step's result into a shared accumulator (swiglu_down), that ordering cost ~0.6 us per
step on the H200 (benchmarks/DECISIONS.md): the adds need atomicity, not ordering, since
the kernel's end orders them for every reader. This primitive is the same Triton atomic with
relaxed semantics. Interpret mode (CPU) uses Pallas' own discharge rule: a plain add.
"""

from __future__ import annotations

from typing import Any

from pallas_kernels._jax_private import (indexing, jax_core, pallas_primitives,
                                         state_discharge, state_primitives, state_types,
                                         tree_util, triton_lowering, triton_primitives, tt_dialect)

relaxed_add_p = jax_core.Primitive("atomic_add_relaxed")


@relaxed_add_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree):
    return pallas_primitives._swap_abstract_eval(*avals_flat, args_tree=args_tree)


@state_discharge.register_discharge_rule(relaxed_add_p)
def _discharge(ctx, *args_flat, args_tree):
    return triton_primitives._atomic_rmw_discharge_rule(
        ctx, *args_flat, args_tree=args_tree, atomic_type=triton_primitives.AtomicOpType.ADD)


@triton_lowering.register_lowering(relaxed_add_p)
def _lowering(ctx, *args_flat, args_tree):
    block_info, *_ = ctx.block_infos
    assert block_info is not None
    ptr, indexers, val, mask = args_tree.unflatten(args_flat)
    *_, value_aval, mask_aval = args_tree.unflatten(ctx.avals_in)
    indexers = list(indexers)
    if not indexers or not isinstance(indexers[-1], indexing.NDIndexer):
        ref_aval = state_types.transform_type(indexers, ctx.avals_in[0])
        indexers.append(indexing.NDIndexer.make_trivial_indexer(ref_aval.shape))
    if len(indexers) != 1:
        raise NotImplementedError("atomic_add_relaxed: one indexer only")
    ptr = triton_lowering._compute_pointers_from_indices(ptr, block_info, indexers[0])
    val = triton_lowering._ensure_ir_value(val, value_aval)
    if mask is not None:
        mask = triton_lowering._ensure_ir_value(mask, mask_aval)
    return triton_lowering._atomic_rmw(tt_dialect.RMWOp.FADD, ptr, val, mask=mask,
                                       semantic=tt_dialect.MemSemantic.RELAXED)


def atomic_add_relaxed(x_ref_or_view, idx, val, *, mask: Any | None = None):
    """ref[idx] += val (float32), each element atomically, with no memory ordering; returns
    the old values (unused here). mask: which elements to add (GPU only: interpret mode
    takes no mask, as Pallas' atomics)."""
    x_ref, transforms = state_primitives.get_ref_and_transforms(x_ref_or_view, idx,
                                                                "atomic_add_relaxed")
    if x_ref.dtype.name != "float32":
        raise ValueError(f"atomic_add_relaxed: float32 refs only, got {x_ref.dtype}")
    args_flat, args_tree = tree_util.tree_flatten((x_ref, transforms, val, mask))
    return relaxed_add_p.bind(*args_flat, args_tree=args_tree)
