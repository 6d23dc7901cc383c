"""`pip install .` puts one package into site-packages: `wasma`, with its data, no studies."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIP_WHEEL = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]


def test_the_wheel_holds_only_the_wasma_package(tmp_path: Path) -> None:
    subprocess.run(
        [*PIP_WHEEL, str(REPO), "-w", str(tmp_path)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("wasma-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # name-version: the wheel is tagged for this interpreter (it holds a C extension).
    dist = "-".join(wheel.name.split("-")[:2])
    assert {n.split("/")[0] for n in names} == {"wasma", f"{dist}.dist-info"}
    # The links under wasma/ are followed: the real modules and their data are inside.
    for path in (
        "wasma/scheduler/dispatch.py",
        "wasma/core/profiles/llama3-8b-h100.yaml",
        "wasma/deploy/grafana/wasma-dashboard.json",
        "wasma/deploy/cli.py",
    ):
        assert path in names
    assert not [n for n in names if "/studies/" in n]
    # The compiled block operations are built by the ordinary install.
    assert [n for n in names if n.startswith("wasma/core/_blockops.") and n.endswith(".so")]
    entry = zipfile.ZipFile(wheel).read(f"{dist}.dist-info/entry_points.txt")
    assert b"wasma = wasma.deploy.cli:main" in entry
