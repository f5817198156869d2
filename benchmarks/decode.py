"""Decode/prefill benchmark: the same as `jaxinfer bench` (see jaxinfer/bench.py).

    PYTHONPATH=. python benchmarks/decode.py --preset llama3-8b --random-weights --batch 1 --json
        [--boundaries xla|kernel|swiglu|consumers] [--o-prefetch FRACTION]

These two (this script only) set model knobs of jaxinfer/models/layers.py, to compare them in
the whole benchmark: where the decode path's sublayer boundaries run (BOUNDARY_MODES), and
how much of the o projection's weight the decode attention kernel pulls into L2 (O_PREFETCH).
"""

import sys

from jaxinfer.cli import main


def _pop_model_knobs(argv: list[str]) -> list[str]:
    from jaxinfer.models import layers

    if "--boundaries" in argv:
        i = argv.index("--boundaries")
        layers.set_boundaries(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if "--o-prefetch" in argv:
        i = argv.index("--o-prefetch")
        layers.O_PREFETCH = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    return argv


if __name__ == "__main__":
    sys.exit(main(["bench", *_pop_model_knobs(sys.argv[1:])]))
