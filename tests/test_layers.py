"""The floors hold: no package imports from a package above it.

Every import in every module counts, those inside functions too (a lazy import is still
an arrow). The floors, bottom up:

    core                      vocabulary: KV events, engine stats, tokens, the profile
    transfer                  topology, planner, executors (nothing else of wasma)
    engines                   the engine interface and its implementations
    scheduler                 DAGs, cluster state, prefix index, policies, the dispatcher
    benchmarks                the tools users run: bench, replay, traces, reports
    deploy, ray_serve         CLI, gateway, service, Ray Serve front end
    benchmarks.studies        one-off experiments (not installed)

The command line (`deploy/cli.py`) is the composition root: it picks the front end a
`wasma serve` runs, so it alone may also import `ray_serve`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# What each package may import from wasma (besides itself).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "transfer": {"core"},
    "engines": {"core", "transfer"},
    "scheduler": {"core", "transfer"},
    "benchmarks": {"core", "transfer", "engines", "scheduler"},
    "deploy": {"core", "transfer", "engines", "scheduler", "benchmarks"},
    "ray_serve": {"core", "transfer", "engines", "scheduler", "benchmarks", "deploy"},
    "benchmarks.studies": {
        "core",
        "transfer",
        "engines",
        "scheduler",
        "benchmarks",
        "deploy",
        "ray_serve",
    },
}


def _package_of(module: str) -> str | None:
    """The floor a dotted module path below `wasma.` belongs to."""
    parts = module.split(".")
    if parts[0] != "wasma" or len(parts) < 2:
        return None
    if parts[1] == "benchmarks" and len(parts) > 2 and parts[2] == "studies":
        return "benchmarks.studies"
    return parts[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "wasma":
                found += [(node.lineno, f"wasma.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


# Modules allowed more than their floor, and why (see the docstring).
EXTRA: dict[str, set[str]] = {"deploy/cli.py": {"ray_serve"}}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in ("core", "transfer", "engines", "scheduler", "benchmarks", "deploy", "ray_serve"):
        root = REPO / pkg
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            floor = "benchmarks.studies" if "studies" in path.relative_to(root).parts else pkg
            out.append((floor, path))
    return out


def test_every_package_is_on_a_floor() -> None:
    names = {p.name for p in (REPO / "wasma").iterdir() if p.is_symlink()}
    assert names <= set(ALLOWED), f"packages without a floor: {names - set(ALLOWED)}"


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_no_import_runs_back_up(floor: str) -> None:
    bad = []
    for own, path in _modules():
        if own != floor:
            continue
        for line, module in _imports(path):
            target = _package_of(module)
            extra = EXTRA.get(path.relative_to(REPO).as_posix(), set())
            if target is None or target == floor or target in ALLOWED[floor] | extra:
                continue
            bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, "imports that run back up:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    # The check itself can fail: a lazy import inside a function is found.
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from wasma.deploy.cli import main\n    return main\n")
    assert [m for _, m in _imports(mod)] == ["wasma.deploy.cli"]
    assert _package_of("wasma.deploy.cli") not in ALLOWED["engines"]
