"""Entry point of the I/O workload's processes (bench.io_apps): the apps live in an importable module, not in
``__main__``."""

from __future__ import annotations

import sys

from bench.io_apps import main

if __name__ == "__main__":
    main(sys.argv[1:])
