"""Decode benchmark: HF eager / HF static+compile / hf_dsinfer bf16, int8, int4 (see
hf_dsinfer/benchmark.py). Same as `hf-dsinfer bench`.

    python benchmarks/decode.py --models llama-1.1b --batch 1 16 --new-tokens 64
"""

import sys

from hf_dsinfer.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
