"""L2 prefetch from inside a Pallas Triton kernel: warm the next kernel's first weight tiles.

    l2_prefetch(ref, offsets, nbytes=)   ask the L2 to fetch ref's bytes [o, o + nbytes) for
                                         every element offset o in offsets (int32 [n]); returns
                                         nothing, waits for nothing
    PrefetchPlan(starts, length)         which elements of a weight the consumer reads first
    program_offsets(plan, program, ...)  this program's share of the plan: one prefetch per
                                         thread
    issue_prefetches(refs, plans, ...)   a kernel's call: its programs' shares of each plan

Why: at batch 1 each decode kernel streams one weight and the HBM idles between two of them,
through the producer's tail (its programs finish unevenly), the launch gap, and the consumer's
ramp (its first loads' HBM latency). A producer program that has finished its own stream can
instead start the consumer's: it issues `prefetch.global.L2::evict_last` per 128-byte line
(fire and forget: no registers, no shared memory, nothing to wait for) for a slice of the rows
the consumer's programs load first, so those loads hit the L2. It pays only at some
boundaries: the KernelPolicy's prefetch fields say which (benchmarks/DECISIONS.md). Weights
are never written, so reading the next kernel's weight early is always correct; the prefetch
only moves data into the cache.

Lowering: one non-pure inline asm per element (so Triton keeps it), whose pointer operand is
ref's base plus the offset. In interpret mode (CPU) it does nothing.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels._jax_private import (effects, jax_core, mlir, pallas_core, state_discharge,
                                         triton_lowering, tt_dialect)


class L2PrefetchEffect(effects.Effect):
    """Keeps the prefetch in place: it has no output that anything uses."""


l2_prefetch_effect = L2PrefetchEffect()
effects.control_flow_allowed_effects.add_type(L2PrefetchEffect)
pallas_core.kernel_local_effects.add_type(L2PrefetchEffect)

l2_prefetch_p = jax_core.Primitive("l2_prefetch")
l2_prefetch_p.multiple_results = True


@l2_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref, offsets, *, nbytes):
    del ref, offsets, nbytes
    return [], {l2_prefetch_effect}


mlir.register_lowering(l2_prefetch_p, lambda ctx, *args, **kw: [])


@state_discharge.register_discharge_rule(l2_prefetch_p)
def _discharge(ctx, ref, offsets, *, nbytes):
    # Interpret mode: a cache hint has no observable effect.
    del ctx, ref, offsets, nbytes
    return [None, None], []


@triton_lowering.register_lowering(l2_prefetch_p)
def _l2_prefetch_lowering(ctx, ptr, offsets, *, nbytes):
    del ctx
    n = triton_lowering.ir.RankedTensorType(offsets.type).shape[0]
    ptrs = triton_lowering._add(triton_lowering._bcast_to(ptr, (n,)), offsets)  # [n] pointers
    i32 = triton_lowering.ir.RankedTensorType.get(
        [n], triton_lowering.ir.IntegerType.get_signless(32))
    # One line prefetch per 128 bytes (measured over Hopper's bulk prefetch:
    # benchmarks/DECISIONS.md). The dummy result only gives the op a type; pure=False keeps
    # it alive.
    asm = " ".join(f"prefetch.global.L2::evict_last [$1+{o}];" for o in range(0, nbytes, 128))
    tt_dialect.elementwise_inline_asm(
        [i32], asm + " mov.u32 $0, 0;",
        constraints="=r,l", pure=False, packed_element=1, args=[ptrs])
    return []


def l2_prefetch(ref, offsets, *, nbytes: int) -> None:
    """Prefetch ref's bytes [o * itemsize, o * itemsize + nbytes) into the L2 for each element
    offset o of offsets (int32 [n], n a power of two; offsets into ref's whole, row-major
    array, which must be passed to the kernel unblocked). nbytes: a multiple of 16, and each
    prefetched address 16-byte aligned."""
    if nbytes % 16 or nbytes <= 0:
        raise ValueError(f"l2_prefetch: nbytes={nbytes} must be a positive multiple of 16")
    l2_prefetch_p.bind(ref, offsets, nbytes=int(nbytes))


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    """The elements of one weight a consumer kernel reads first: `length` elements at each of
    `starts` (one range per K chunk of a split-K consumer: the chunk's first rows, all columns,
    contiguous in a row-major [K, N] weight). Static, so it can be a jit static argument."""
    starts: tuple[int, ...]
    length: int
    at: str = "end"  # when the producer's programs prefetch: "start" or "end" of their stream

    def __post_init__(self):
        if self.at not in ("start", "end"):
            raise ValueError(f"PrefetchPlan.at={self.at!r}: one of 'start', 'end'")

    @property
    def elements(self) -> int:
        return len(self.starts) * self.length


def plan_programs(plan: PrefetchPlan, programs: int, threads: int,
                  itemsize: int) -> tuple[int, int, int]:
    """How `programs` producer programs of `threads` threads share the plan, one prefetch
    instruction (a chunk) per thread: (chunks per program = threads; elements per chunk, the smallest power
    of two that covers the plan in programs * threads chunks and divides the range length;
    chunks in all). Program p takes chunks [p * per, (p + 1) * per); chunk c covers elements
    [starts[c // per_range] + (c % per_range) * chunk, ... + chunk)."""
    min_chunk = max(1, 16 // itemsize)  # the instruction's 16-byte granule
    chunk = max(min_chunk, 1 << math.ceil(math.log2(max(1, -(-plan.elements
                                                          // (programs * threads))))))
    while plan.length % chunk and chunk > min_chunk:
        chunk //= 2
    if plan.length % chunk:
        raise ValueError(f"l2_prefetch: a range of {plan.length} elements is not a multiple "
                         f"of {min_chunk}")
    return threads, chunk, plan.elements // chunk


def program_offsets(plan: PrefetchPlan, program, programs: int, threads: int, itemsize: int):
    """Inside a kernel: this program's element offsets (int32 [threads]) and the bytes of each
    prefetch, under plan_programs. Chunks past the end repeat the plan's last chunk (a
    duplicate prefetch costs an instruction, nothing more)."""
    per, chunk, total = plan_programs(plan, programs, threads, itemsize)
    c = jnp.minimum(program * per + jnp.arange(per, dtype=jnp.int32), total - 1)  # [per]
    per_range = plan.length // chunk
    r = c // per_range
    steps = {b - a for a, b in zip(plan.starts, plan.starts[1:])}
    if len(steps) <= 1:  # evenly spaced ranges (K chunks): one multiply-add
        start = plan.starts[0] + r * (steps.pop() if steps else 0)
    else:
        start = jnp.zeros_like(c)
        for i, s in enumerate(plan.starts):
            start = jnp.where(r == i, jnp.int32(s), start)
    return start + (c % per_range) * chunk, chunk * itemsize


def issue_prefetches(refs, plans, program, programs: int, threads: int, at: str) -> None:
    """Inside a kernel of `programs` programs of `threads` threads: this program's share of
    each plan whose `at` is `at` (refs: the planned arrays' whole refs, one per plan)."""
    for ref, plan in zip(refs, plans):
        if plan.at == at:
            offsets, nbytes = program_offsets(plan, program, programs, threads,
                                              ref.dtype.itemsize)
            l2_prefetch(ref, offsets, nbytes=nbytes)
