"""The wheel holds only the polyspec package tree: nothing generic (data, train, ...) lands in site-packages."""

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_has_only_polyspec(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("polyspec-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"polyspec", next(t for t in tops if t.endswith(".dist-info"))}, tops
    for sub in ("data", "decode", "train", "quantize", "export"):
        assert f"polyspec/{sub}/__init__.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "polyspec = polyspec.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()
