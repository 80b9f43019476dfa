"""Entry point of a peer's process (bench.peer_apps): the apps live in an importable module, not in ``__main__``."""

from __future__ import annotations

import sys

from bench.peer_apps import main

if __name__ == "__main__":
    main(sys.argv[1:])
