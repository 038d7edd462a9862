"""`python -m dllm_serve` = `dllm-serve`."""

import sys

from dllm_serve.cli import main

# The guard matters: the engine spawns its children, which re-import this module.
if __name__ == "__main__":
    sys.exit(main())
