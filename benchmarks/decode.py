"""Decode/prefill benchmark: the same as `jaxinfer bench` (see jaxinfer/bench.py).

    PYTHONPATH=. python benchmarks/decode.py --preset llama3-8b --random-weights --batch 1 --json
        [--boundaries xla|kernel|swiglu|consumers] [--qkv-attention on|off]

These two options (this script only) pick where the decode path's sublayer boundaries run
(jaxinfer/models/layers.py, BOUNDARY_MODES) and whether the attention runs in the q/k/v
kernel's tail (layers.QKV_ATTENTION), to compare them in the whole benchmark.
"""

import sys

from jaxinfer.cli import main


def _pop_options(argv: list[str]) -> list[str]:
    from jaxinfer.models import layers

    if "--boundaries" in argv:
        i = argv.index("--boundaries")
        layers.set_boundaries(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if "--qkv-attention" in argv:
        i = argv.index("--qkv-attention")
        if argv[i + 1] not in ("on", "off"):
            raise SystemExit(f"--qkv-attention takes on or off, got {argv[i + 1]!r}")
        layers.QKV_ATTENTION = argv[i + 1] == "on"
        argv = argv[:i] + argv[i + 2:]
    return argv


if __name__ == "__main__":
    sys.exit(main(["bench", *_pop_options(sys.argv[1:])]))
