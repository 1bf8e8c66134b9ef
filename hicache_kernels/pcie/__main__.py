"""``python -m hicache_kernels.pcie``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
