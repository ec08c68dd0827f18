"""Start SGLang's HTTP server in its CPU mode, its keys read from environment variables.

    python -m backends.sglang_cpu.serve [--api-key-env VAR] [--admin-api-key-env VAR] SGLANG_ARGS...

``SGLANG_ARGS`` are ``python -m sglang.launch_server``'s own (``--model-path``, ``--port``,
``--device cpu``, ...). This wrapper sets the CPU mode's environment (and pins
``SGLANG_RETURN_ORIGINAL_LOGPROB=0``, the project's log-prob convention), checks the shims are active,
and passes the keys held by the named variables to the server as its ``--api-key`` /
``--admin-api-key``: a key on the command line would be readable by every local user (``ps``) and
land in shell history, so ``--api-key`` / ``--admin-api-key`` are refused here. Run it with the
SGLang venv's interpreter (``recipes/install/sglang_cpu.sh``).
"""

from __future__ import annotations

import argparse
import os
import sys

from backends.sglang_cpu import CPU_ENGINE_ENV, cpu_mode_problems

_KEY_FLAGS = {"--api-key": "--api-key-env", "--admin-api-key": "--admin-api-key-env"}


def _key(var: str | None, flag: str) -> str | None:
    if var is None:
        return None
    key = os.environ.get(var, "").strip()
    if not key:
        raise SystemExit(f"{flag} names environment variable {var}, which is not set (or empty); export it first")
    return key


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m backends.sglang_cpu.serve", add_help=False, allow_abbrev=False)
    parser.add_argument("--api-key-env", help="variable holding the key of normal endpoints (/generate, ...)")
    parser.add_argument("--admin-api-key-env", help="variable holding the key of admin endpoints (weights, flush)")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    for flag, named in _KEY_FLAGS.items():
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise SystemExit(f"{flag}: keys do not go on the command line; put it in a variable and pass {named} VAR")
    problems = cpu_mode_problems()
    if problems:
        raise SystemExit("SGLang CPU mode is not set up:\n- " + "\n- ".join(problems))
    os.environ.update(CPU_ENGINE_ENV, SGLANG_RETURN_ORIGINAL_LOGPROB="0")
    api_key, admin_key = _key(args.api_key_env, "--api-key-env"), _key(args.admin_api_key_env, "--admin-api-key-env")

    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(rest)
    server_args.api_key, server_args.admin_api_key = api_key, admin_key
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
