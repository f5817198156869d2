"""Decode/prefill benchmark: the same as `jaxinfer bench` (see jaxinfer/bench.py).

    PYTHONPATH=. python benchmarks/decode.py --preset llama3-8b --random-weights --batch 1 --json
        [--boundaries xla|kernel|swiglu|consumers] [--attention-o SLOTS[,BLOCK_N]]

--boundaries (this script only) picks where the decode path's sublayer boundaries run
(jaxinfer/models/layers.py, BOUNDARY_MODES), to compare them in the whole benchmark;
--attention-o sets when the o projection runs in the decode attention kernel
(layers.set_attention_o: caches of <= SLOTS slots, 0 never; BLOCK_N columns per program).
"""

import sys

from jaxinfer.cli import main


def _pop_options(argv: list[str]) -> list[str]:
    from jaxinfer.models import layers

    if "--boundaries" in argv:
        i = argv.index("--boundaries")
        layers.set_boundaries(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if "--attention-o" in argv:
        i = argv.index("--attention-o")
        layers.set_attention_o(*(int(v) for v in argv[i + 1].split(",")))
        argv = argv[:i] + argv[i + 2:]
    return argv


if __name__ == "__main__":
    sys.exit(main(["bench", *_pop_options(sys.argv[1:])]))
