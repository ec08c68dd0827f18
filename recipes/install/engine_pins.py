"""What an installed engine's wheel requires, read from its own metadata: the GPU install pins exactly that.

Usage:
    python recipes/install/engine_pins.py DIST PACKAGE...          # print DIST's requirement of each PACKAGE
    python recipes/install/engine_pins.py --check DIST PACKAGE...  # exit 1 unless the installed ones satisfy it

e.g. ``python recipes/install/engine_pins.py sglang torch`` prints ``torch==2.14.1`` for sglang 0.5.23.
Markers are evaluated for this machine; a package DIST does not require prints nothing. ``gpu.sh`` writes
these lines into a pip constraints file, so installing this project next to the engine moves nothing the
engine pinned. ``tests/test_install_pins.py`` holds the install scripts to the same metadata.
"""

from __future__ import annotations

import importlib.metadata
import sys

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # a bare venv: pip carries packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version


def _name(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements(dist: str) -> dict[str, Requirement]:
    """Every requirement of the installed distribution ``dist`` that applies here (no extras), by package name."""
    found = {}
    for line in importlib.metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        found[_name(req.name)] = req
    return found


def required(dist: str, package: str) -> Requirement | None:
    """``dist``'s requirement of ``package`` (None when it has none)."""
    return requirements(dist).get(_name(package))


def unmet(dist: str, packages: list[str]) -> list[str]:
    """The packages whose installed version does not satisfy ``dist``'s requirement, each with why."""
    problems = []
    for package in packages:
        req = required(dist, package)
        if req is None:
            continue
        try:
            have = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{package}: not installed, {dist} requires {req}")
            continue
        if not req.specifier.contains(Version(have), prereleases=True):
            problems.append(f"{package}: {have} installed, {dist} requires {req}")
    return problems


def main(argv: list[str]) -> int:
    check = argv[:1] == ["--check"]
    args = argv[1:] if check else argv
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dist, packages = args[0], args[1:]
    if check:
        problems = unmet(dist, packages)
        for p in problems:
            print(f"engine_pins: {p}", file=sys.stderr)
        return 1 if problems else 0
    for package in packages:
        req = required(dist, package)
        if req is not None:
            req.marker = None
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
