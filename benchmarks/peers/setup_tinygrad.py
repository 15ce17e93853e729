"""Build the separate virtual environments that the tinygrad side of the peer benchmark runs in.

Each pinned tinygrad release (``RELEASES``) is installed from PyPI into its own
environment under ``benchmarks/peers/`` (``.venv-tinygrad`` for 0.13.0,
``.venv-tinygrad-0.10.1`` for 0.10.1; both gitignored), never into the
project's own environment. Both CPU backends compile kernels with clang
(0.13.0's ``ClangJITCompiler`` and 0.10.1's: ``clang -c -x c
--target=<arch>-none-unknown-elf -ffreestanding -nostdlib ...``, then
tinygrad's own ELF loader), so clang must be on ``PATH``.

Every step is idempotent: an existing environment with its pinned version is
reused as is. Run ``python -m benchmarks.peers.setup_tinygrad`` to build them by
hand (``--version`` picks one; ``--install-clang`` also installs Debian's clang
with apt-get when it is missing and this process is root).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "tinygrad_worker.py"


@dataclass(frozen=True)
class Release:
    """One pinned tinygrad release and the virtual environment it is installed in."""

    version: str
    venv: Path
    min_python: tuple[int, int]
    """The release's ``Requires-Python``."""


TINYGRAD_VERSION = "0.13.0"
"""The newest tinygrad release whose CPU device still loads raw C source through
``Device["CPU"].compiler.compile`` and ``Device["CPU"].runtime(name, lib)`` (0.14.0 replaced
that with ``TinyELF`` objects built from tinygrad's own IR); it runs programs on a worker thread per device."""

TINYGRAD_CLANG_VERSION = "0.10.1"
"""The tinygrad release whose CPU device is ``CLANG``: ``Device["CLANG"].compiler.compile(src)`` builds raw C
source, and the program that ``Device["CLANG"].runtime(name, lib)`` loads runs on the caller's thread."""

RELEASES = {
    r.version: r
    for r in (
        Release(TINYGRAD_VERSION, HERE / ".venv-tinygrad", (3, 11)),
        Release(TINYGRAD_CLANG_VERSION, HERE / ".venv-tinygrad-0.10.1", (3, 10)),
    )
}
"""Every pinned release, by version."""


class PeerUnavailable(RuntimeError):
    """The tinygrad side cannot run here; the message says exactly why and how to fix it."""


def venv_python(venv: Path) -> Path:
    """The interpreter of a tinygrad virtual environment (it may not exist yet)."""
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def installed_version(venv: Path) -> str | None:
    """The tinygrad version installed in ``venv``, or None when there is none (or no venv)."""
    python = venv_python(venv)
    if not python.exists():
        return None
    probe = "import importlib.metadata as m; print(m.version('tinygrad'))"
    try:
        proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def base_python(release: Release) -> str:
    """An interpreter new enough for ``release``: this one, else the newest ``python3.1x`` on PATH."""
    if sys.version_info >= release.min_python:
        return sys.executable
    for minor in range(20, release.min_python[1] - 1, -1):
        found = shutil.which(f"python3.{minor}")
        if found:
            return found
    need = ".".join(map(str, release.min_python))
    here = sys.version.split()[0]
    raise PeerUnavailable(f"tinygrad {release.version} needs Python >= {need}; none found (this is {here})")


def ensure_venv(version: str = TINYGRAD_VERSION) -> Path:
    """Create the environment of the pinned release ``version`` unless it already has it; return its interpreter.

    Raises :class:`PeerUnavailable` with pip's own message when the install fails
    (for example when PyPI cannot be reached).
    """
    release = RELEASES[version]
    venv = release.venv
    if installed_version(venv) == version:
        return venv_python(venv)
    python = venv_python(venv)
    if not python.exists():
        made = subprocess.run(
            [base_python(release), "-m", "venv", "--clear", str(venv)], capture_output=True, text=True
        )
        if made.returncode != 0:
            raise PeerUnavailable(f"could not create {venv}: {_tail(made.stderr or made.stdout)}")
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", f"tinygrad=={version}"],
        capture_output=True,
        text=True,
    )
    if pip.returncode != 0:
        why = _tail(pip.stderr or pip.stdout)
        raise PeerUnavailable(f"pip could not install tinygrad=={version} into {venv}: {why}")
    got = installed_version(venv)
    if got != version:
        raise PeerUnavailable(f"{venv} has tinygrad {got!r} after installing {version}")
    return python


def find_clang() -> str | None:
    """The clang that tinygrad's CPU compiler will run (``CC`` when it names a clang, else ``clang``)."""
    cc = os.environ.get("CC", "")
    if cc and "clang" in Path(cc).name:
        found = shutil.which(cc)
        if found:
            return found
    return shutil.which("clang")


def ensure_clang(install: bool = False) -> str:
    """The path of clang; with ``install``, ``apt-get install -y clang`` first when it is missing (root only)."""
    found = find_clang()
    if found:
        return found
    why = (
        "tinygrad's CPU backend compiles C with clang (ClangJITCompiler runs"
        " `clang -c --target=<arch>-none-unknown-elf`, which gcc does not accept), and no clang is on PATH"
    )
    if not install:
        raise PeerUnavailable(f"{why}; install it with `apt-get install -y clang` or run with --install-clang")
    apt = shutil.which("apt-get")
    if apt is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        raise PeerUnavailable(f"{why}; installing needs apt-get as root, which this process is not")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run([apt, "install", "-y", "clang"], capture_output=True, text=True, env=env)
    if proc.returncode != 0:  # the package lists may be missing or stale
        subprocess.run([apt, "update"], capture_output=True, text=True, env=env)
        proc = subprocess.run([apt, "install", "-y", "clang"], capture_output=True, text=True, env=env)
    found = find_clang()
    if found is None:
        raise PeerUnavailable(f"{why}; `apt-get install -y clang` failed: {_tail(proc.stderr or proc.stdout)}")
    return found


def ensure(version: str = TINYGRAD_VERSION, install_clang: bool = False) -> Path:
    """Both prerequisites of the tinygrad worker on release ``version``; returns its venv's interpreter."""
    ensure_clang(install_clang)
    return ensure_venv(version)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--install-clang", action="store_true", help="apt-get install clang when it is missing")
    parser.add_argument(
        "--version", action="append", choices=sorted(RELEASES), help="build only this release (repeatable)"
    )
    args = parser.parse_args(argv)
    failed = False
    try:
        clang = ensure_clang(args.install_clang)
    except PeerUnavailable as exc:
        print(f"tinygrad peers unavailable: {exc}", file=sys.stderr)
        return 1
    for version in args.version or RELEASES:
        try:
            python = ensure_venv(version)
        except PeerUnavailable as exc:
            print(f"tinygrad {version} unavailable: {exc}", file=sys.stderr)
            failed = True
        else:
            print(f"tinygrad {version} in {python}; clang at {clang}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
