"""Replay a Python-based Dockerfile stage without Docker, to check what it installs.

Machines without a Docker daemon (CI runners, this project's build hosts) cannot build the
images, yet the gateway stage's job is plain Python: copy the sources, pip-install them into
`python:3.11-slim`, run the import checks. This module reads the stage from the Dockerfile
itself (so the check cannot drift from the file), stands a fresh virtual environment in for
the base image, copies the same sources, and runs the stage's Python commands with its
`ENV` and `ARG` values. Commands that need root or the base image's system (`groupadd`,
`useradd`, `apt-get`) are listed as skipped, not run. The result is the installed size and
whether every check in the stage passed:

    python -m wasma.deploy.dockerfile_stage --target gateway --out /tmp/wasma-gateway
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass, field
from pathlib import Path

# Programs a replay runs: the Python toolchain, which the virtual environment provides.
# Everything else needs the image's operating system and is reported, not run.
RUNNABLE = frozenset({"python", "python3", "pip", "pip3", "wasma", "true"})
# Base images a fresh virtual environment can stand in for.
PYTHON_BASE = re.compile(r"^python:3\.\d+(-slim|-slim-\w+)?$")
_VAR = re.compile(r"\$\{(\w+)\}|\$(\w+)")


class StageError(ValueError):
    """The Dockerfile or the stage cannot be replayed (the message says why)."""


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    name: str
    base: str
    args: dict[str, str] = field(default_factory=dict)
    instructions: list[Instruction] = field(default_factory=list)


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction (Docker drops those too)
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        if whole:
            keyword, _, rest = whole.partition(" ")
            out.append(Instruction(keyword.upper(), rest.strip()))
    if pending.strip():
        raise StageError("the Dockerfile ends inside a continued line")
    return out


def substitute(value: str, env: dict[str, str]) -> str:
    """`${NAME}` and `$NAME` replaced from `env` (unset names become empty, as in Docker)."""
    return _VAR.sub(lambda m: env.get(m.group(1) or m.group(2), ""), value)


def assignments(text: str) -> dict[str, str]:
    """`A=1 B="two words"` (ARG and ENV syntax) as a dict; a bare `A` is `A=""`."""
    out: dict[str, str] = {}
    for word in shlex.split(text):
        name, _, value = word.partition("=")
        out[name] = value
    return out


def stage(text: str, target: str, build_args: dict[str, str] | None = None) -> Stage:
    """The stage named `target`, its base image resolved from the global ARGs."""
    given = dict(build_args or {})
    global_args: dict[str, str] = {}
    current: Stage | None = None
    found: Stage | None = None
    for ins in instructions(text):
        if ins.keyword == "FROM":
            words = ins.args.split()
            if len(words) == 3 and words[1].upper() == "AS":
                name = words[2]
            elif len(words) == 1:
                name = ""
            else:
                raise StageError(f"cannot read FROM {ins.args!r}")
            scope = global_args | {k: v for k, v in given.items() if k in global_args}
            current = Stage(name, substitute(words[0], scope))
            if name == target:
                found = current
            continue
        if current is None:
            if ins.keyword != "ARG":
                raise StageError(f"{ins.keyword} before the first FROM")
            for key, value in assignments(ins.args).items():
                global_args[key] = substitute(given.get(key, value), global_args)
            continue
        current.instructions.append(ins)
    if found is None:
        names = ", ".join(repr(s) for s in _stage_names(text)) or "none"
        raise StageError(f"no stage named {target!r} (stages: {names})")
    return found


def _stage_names(text: str) -> list[str]:
    return [
        i.args.split()[2]
        for i in instructions(text)
        if i.keyword == "FROM" and len(i.args.split()) == 3
    ]


@dataclass
class Step:
    instruction: str
    ran: bool
    ok: bool
    detail: str = ""


@dataclass
class Replay:
    stage: str
    base: str
    prefix: Path
    steps: list[Step]
    site_packages_bytes: int
    largest: list[tuple[str, int]]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.steps)


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            file = Path(root, name)
            if not file.is_symlink():
                total += file.stat().st_size
    return total


def _programs(command: str) -> list[str]:
    """The program of each part of a `&&` / `||` / `;` / `|` chain, quotes respected."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    programs: list[str] = []
    expect = True  # the next word starts a command
    for token in lexer:
        if token in ("&&", "||", ";", "|", "(", ")", ">", ">>", "<", "2>", "&"):
            expect = token not in (">", ">>", "<", "2>")
            continue
        if expect:
            programs.append(token)
            expect = False
    return programs


def replay(
    dockerfile: Path,
    target: str,
    out: Path,
    context: Path | None = None,
    build_args: dict[str, str] | None = None,
) -> Replay:
    """Replay stage `target` of `dockerfile` under `out` (created; must not exist)."""
    text = dockerfile.read_text()
    st = stage(text, target, build_args)
    if not PYTHON_BASE.match(st.base):
        raise StageError(
            f"stage {target!r} is built on {st.base!r}; only stages on a python:3.x image "
            "can be replayed without Docker"
        )
    if out.exists():
        raise StageError(f"{out} exists; give a new directory")
    context = (context or dockerfile.parent.parent).resolve()
    prefix = out / "venv"
    root = out / "root"  # absolute paths of the image (WORKDIR, COPY targets) live here
    root.mkdir(parents=True)
    commands = [i.args for i in st.instructions if i.keyword == "RUN"]
    venv.EnvBuilder(with_pip=any("pip" in c for c in commands), symlinks=True).create(prefix)

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{prefix / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(prefix)
    given = dict(build_args or {})
    workdir = root
    steps: list[Step] = []
    for ins in st.instructions:
        kw = ins.keyword
        if kw == "ARG":
            for key, value in assignments(ins.args).items():
                env[key] = given.get(key, substitute(value, env))
        elif kw == "ENV":
            for key, value in assignments(ins.args).items():
                value = substitute(value, env)
                # An empty value (an unset build argument) leaves the host's own setting,
                # so the host's pip configuration (wheel locations) still applies.
                if value:
                    env[key] = value
        elif kw == "WORKDIR":
            workdir = root / substitute(ins.args, env).lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif kw == "COPY":
            *sources, dest = shlex.split(substitute(ins.args, env))
            if any(s.startswith("--") for s in sources):
                raise StageError(f"COPY flags are not replayed: {ins.args!r}")
            for source in sources:
                src = context / source.rstrip("/")
                if not src.exists():
                    raise StageError(f"COPY source {source!r} is not in {context}")
                if src.is_dir():
                    # Docker copies a directory's contents, links kept as links.
                    shutil.copytree(
                        src,
                        workdir / dest,
                        symlinks=True,
                        dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                    )
                elif dest.endswith("/") or len(sources) > 1:
                    (workdir / dest).mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, workdir / dest / src.name)
                else:
                    shutil.copy2(src, workdir / dest)
            steps.append(Step(f"COPY {ins.args}", ran=True, ok=True))
        elif kw == "RUN":
            command = ins.args  # the shell expands its variables from `env`
            programs = _programs(command)
            if not set(programs) <= RUNNABLE:
                others = sorted(set(programs) - RUNNABLE)
                steps.append(
                    Step(
                        f"RUN {command}",
                        ran=False,
                        ok=True,
                        detail=f"skipped: needs the image's system ({', '.join(others)})",
                    )
                )
                continue
            done = subprocess.run(
                ["/bin/sh", "-c", command],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            steps.append(
                Step(
                    f"RUN {command}",
                    ran=True,
                    ok=done.returncode == 0,
                    detail="\n".join(tail) if done.returncode else "",
                )
            )
            if done.returncode:
                break
        # USER, EXPOSE, CMD, ENTRYPOINT, LABEL describe the image; nothing to replay.
    site = next((prefix / "lib").glob("python3*/site-packages"))
    largest = sorted(
        ((p.name, _size(p) if p.is_dir() else p.stat().st_size) for p in site.iterdir()),
        key=lambda x: -x[1],
    )[:8]
    return Replay(target, st.base, prefix, steps, _size(site), largest)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m wasma.deploy.dockerfile_stage",
        description="Replay a python-based Dockerfile stage without Docker.",
    )
    parser.add_argument("--dockerfile", type=Path, default=Path("deploy/Dockerfile"))
    parser.add_argument("--target", default="gateway")
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--context", type=Path, default=Path("."))
    parser.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    ns = parser.parse_args(argv)
    try:
        result = replay(
            ns.dockerfile,
            ns.target,
            ns.out,
            ns.context,
            assignments(" ".join(shlex.quote(a) for a in ns.build_arg)),
        )
    except (StageError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"stage {result.stage!r} (on {result.base}, replayed in {result.prefix})")
    for step in result.steps:
        mark = "ok  " if step.ok and step.ran else ("skip" if step.ok else "FAIL")
        print(f"  {mark} {step.instruction[:110]}")
        if step.detail:
            print("       " + step.detail.replace("\n", "\n       "))
    print(
        f"installed: {_mib(result.site_packages_bytes)} in site-packages; largest: "
        + ", ".join(f"{n} {_mib(b)}" for n, b in result.largest)
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
