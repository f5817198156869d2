"""The private JAX names the kernels use exist, under the jax version they were written for.

pallas_kernels/_jax_private.py is the one module that imports `jax._src`; this test fails
loudly under any other jax, so an upgrade starts by re-checking those uses.
"""

import importlib
import pathlib

import jax

from pallas_kernels import _jax_private

ROOT = pathlib.Path(__file__).parent.parent


def test_jax_is_the_pinned_version():
    assert jax.__version__ == _jax_private.PINNED_JAX, (
        f"jax {jax.__version__} is installed but pallas_kernels/_jax_private.py was checked "
        f"against jax {_jax_private.PINNED_JAX}: re-check every private name it lists (the "
        f"relaxed atomic and the L2 prefetch lower through them), then update PINNED_JAX")


def test_every_private_name_resolves():
    missing = [f"{mod}.{name}" for mod, name in _jax_private.USED
               if not hasattr(getattr(_jax_private, mod), name)]
    assert not missing, f"private jax names gone: {missing}"


def test_no_other_module_imports_jax_private_modules():
    offenders = []
    for folder in ("jaxinfer", "pallas_kernels", "checkpoints", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "_jax_private.py":
                continue
            if "jax._src" in path.read_text():
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"jax._src used outside pallas_kernels/_jax_private.py: {offenders}"
    importlib.import_module("pallas_kernels.atomics")  # the users import cleanly
    importlib.import_module("pallas_kernels.l2_prefetch")
