"""Decode/prefill benchmark: the same as `jaxinfer bench` (see jaxinfer/bench.py).

    PYTHONPATH=. python benchmarks/decode.py --preset llama3-8b --random-weights --batch 1 --json
        [--boundaries xla|kernel|swiglu|consumers]

--boundaries (this script only) picks where the decode path's sublayer boundaries run
(jaxinfer/models/layers.py, BOUNDARY_MODES), to compare them in the whole benchmark.
"""

import sys

from jaxinfer.cli import main


def _pop_boundaries(argv: list[str]) -> list[str]:
    from jaxinfer.models import layers

    if "--boundaries" in argv:
        i = argv.index("--boundaries")
        layers.set_boundaries(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    return argv


if __name__ == "__main__":
    sys.exit(main(["bench", *_pop_boundaries(sys.argv[1:])]))
