"""`python3 -m benchmarks.gpu_check ...` from the checkout: the GPU check (the package's docstring)."""

import sys

from benchmarks.gpu_check.cli import main

if __name__ == "__main__":
    sys.exit(main())
