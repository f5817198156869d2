"""Timing a chain of weight-streaming kernels inside one executable (pdl_probe.py,
grid_barrier_probe.py).

A chain fn(x, weights) -> x runs `repeats` times in one jitted loop, so the host's dispatch is
paid once; the time per layer is compared with the weight bytes at the H200's copy bandwidth.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
from jax import lax

HBM_TBS = 4.27  # ../shared/docs/GPU.md, measured copy bandwidth of the H200


def measure_chain(name: str, fn, x, weights, want, *, layers: int, repeats: int,
                  layer_bytes: int, label: str = "", racy: bool = False, unroll: bool = False):
    """Time fn(x, weights) per layer and check its first row against want's. Returns the
    result row (dict), or None when the variant fails (printed; the caller goes on).
    racy: a variant wrong by design (a timing probe), not counted as failing the check.
    unroll: the repeats written out in one program instead of a loop (XLA's GPU while loop
    returns to the host between iterations, a gap of ~1-3 us per layer of a 16-layer chain)."""
    try:
        got = jax.block_until_ready(jax.jit(fn)(x, weights))
        diff = (got[:1] - want[:1]).astype(jnp.float32)
        err = float(jnp.linalg.norm(diff) / jnp.linalg.norm(want[:1].astype(jnp.float32)))
        if unroll:
            def repeated(x, w):
                for _ in range(repeats):
                    x = fn(x, w)
                return x
            run = jax.jit(repeated)
        else:
            run = jax.jit(lambda x, w: lax.fori_loop(0, repeats, lambda _, x: fn(x, w), x))
        jax.block_until_ready(run(x, weights))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(run(x, weights))
            times.append(time.perf_counter() - t0)
    except Exception as e:  # one failing variant does not hide the others
        print(f"{label}{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    sec = min(times) / (repeats * layers)
    row = dict(variant=name, us_per_layer=sec * 1e6, tbs=layer_bytes / sec / 1e12,
               us_over_floor=sec * 1e6 - layer_bytes / HBM_TBS / 1e6, rel_err=err,
               ok=racy or err < 2e-2)
    print(f"{label}{name:24s} {row['us_per_layer']:7.2f} us/layer  {row['tbs']:.2f} TB/s  "
          f"+{row['us_over_floor']:.2f} us over bytes/{HBM_TBS}TB/s  rel err {err:.1e}",
          flush=True)
    return row


def measure_all(cases, weights, want, *, dim: int, layers: int, repeats: int,
                label: str = "", unroll: bool = False) -> tuple[list, int]:
    """measure_chain for each (name, fn, x, racy) of `cases`: the rows (with `dim`) and the
    number of variants that failed to run."""
    rows, failures = [], 0
    for name, fn, x, racy in cases:
        row = measure_chain(name, fn, x, weights, want, layers=layers, repeats=repeats,
                            layer_bytes=dim * dim * 2, label=label, racy=racy, unroll=unroll)
        if row is None:
            failures += 1
        else:
            rows.append(dict(row, dim=dim))
    return rows, failures


def finish(rows: list, failures: int, json_path: str | None) -> int:
    """Write the rows (JSON) where asked; the exit status: 0 when every variant ran and
    passed its check, else 2."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if failures == 0 and all(r["ok"] for r in rows) else 2
