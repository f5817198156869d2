"""Decode/prefill benchmark: the same as `jaxinfer bench` (see jaxinfer/bench.py).

    PYTHONPATH=. python benchmarks/decode.py --preset llama3-8b --random-weights --batch 1 --json
"""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
