"""``python -m rlhf_sg.bench NAME [args]``: run one benchmark (``--help`` after NAME for its flags)."""

import importlib
import pkgutil
import sys

import rlhf_sg.bench as bench_pkg


def available() -> list[str]:
    modules = pkgutil.iter_modules(bench_pkg.__path__)
    return sorted(m.name.replace("_", "-") for m in modules if not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m rlhf_sg.bench NAME [args]\nbenchmarks: {', '.join(names)}")
        return
    name = argv[0]
    if name not in names:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(names)}")
    importlib.import_module(f"rlhf_sg.bench.{name.replace('-', '_')}").main(argv[1:])


if __name__ == "__main__":
    main()
