"""``python -m polyspec.train RECIPE [a.b=v ...] [--no-progress]``: the same as ``polyspec train RECIPE ...``.

Kept for the scripts and docs that start the train stage this way.
"""

import sys

from polyspec.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["train", *sys.argv[1:]]))
