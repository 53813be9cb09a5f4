"""``python -m polyspec.quantize RECIPE [a.b=v ...]``: the same as ``polyspec quantize RECIPE ...``."""

import sys

from polyspec.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["quantize", *sys.argv[1:]]))
