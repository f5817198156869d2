"""Decode/prefill benchmark: `jaxinfer bench` (jaxinfer/bench.py) run from a checkout.

    PYTHONPATH=. python benchmarks/decode.py --preset llama3-8b --random-weights --batch 1 --json
        [--policy default|deterministic|reference]

Runs from any checkout without an install, so an older commit checked out beside (an ignored
folder on PYTHONPATH) runs the same benchmark in the same device call.
"""

import sys

from jaxinfer.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
