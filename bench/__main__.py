"""``python -m polyspec.bench CHAIN ...``: the same as ``polyspec bench CHAIN ...``."""

import sys

from polyspec.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
