"""JAX's persistent compilation cache, on by default under the jaxinfer cache directory.

A fresh process then loads the decode step and prefill executables from disk instead of
compiling them again (on the 2-core CPU machine: ~4 s of a one-line answer). JAX keys each
entry on the lowered program, the compile options, the jax/jaxlib version and the device, so
a new plan (another kernel policy, batch or cache bucket), jax version or GPU compiles afresh
and never reuses a stale executable.

    $JAXINFER_CACHE/xla (default ~/.cache/jaxinfer/xla)   where entries live
    JAXINFER_COMPILATION_CACHE=0                            off for this process
    jax's own jax_compilation_cache_dir, when set, wins     (JAX_COMPILATION_CACHE_DIR)
"""

from __future__ import annotations

import logging
import os
import pathlib

log = logging.getLogger(__name__)

# Programs that compile faster than this are not written (JAX's default is 1 s, which would
# skip the tiny test models' steps and a small model's prefill on a fast machine).
MIN_COMPILE_SECONDS = 0.2

_OFF = ("0", "off", "false", "no")


def enable() -> pathlib.Path | None:
    """Point JAX's persistent cache at the jaxinfer cache (idempotent); returns its directory,
    or None when JAXINFER_COMPILATION_CACHE turns it off."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    from checkpoints.registry import compilation_cache_dir

    if os.environ.get("JAXINFER_COMPILATION_CACHE", "").strip().lower() in _OFF:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:  # the user's (or an earlier enable's) choice
        return pathlib.Path(current)
    path = compilation_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home must not stop a run: compile every time instead
        log.warning("compilation cache disabled: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    cc.set_cache_dir(str(path))
    # A compile before this call fixed the cache as unused for the process; start it over.
    cc.reset_cache()
    log.info("compilation cache: %s", path)
    return path
