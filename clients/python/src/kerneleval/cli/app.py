"""`kerneleval`'s main: parse, dispatch the command with a client, turn errors into messages
and exit codes; `serve`, `mcp` and `tenant-token`, which need no client."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import secrets
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format

from kerneleval import errors, gpumode, render
from kerneleval.cli.flags import admin_token, credentials, tenant_token
from kerneleval.cli.output import EXIT_INTERRUPTED, EXIT_SERVICE, EXIT_USAGE, Output, flag_hint
from kerneleval.cli.parser import build_parser, hide_secrets
from kerneleval.client import ADMIN_TOKEN_ENV, Client, resolve_address

SERVE = (  # `kerneleval serve`'s interpreter: named `kerneleval` in --help (program_name)
    "import sys; from kerneleval_server.main import main; sys.argv[0] = 'kerneleval'; "
    "sys.exit(main())"
)


def cmd_serve(argv: Sequence[str]) -> int:
    try:
        if importlib.util.find_spec("kerneleval_server.main") is None:
            raise ImportError("No module named 'kerneleval_server.main'")
    except ImportError as e:
        print(
            "kerneleval serve needs the server package (kerneleval-server), which is not "
            f"installed here ({e}).\nInstall it from the repository root: pip install -e . "
            "(or run `make serve`).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # The server's own `serve` subcommand, in a fresh interpreter: this one loaded gRPC
    # already, before the server could set what gRPC reads as it loads (its __init__).
    os.execv(sys.executable, [sys.executable, "-c", SERVE, "serve", *argv])


def cmd_mcp(a: argparse.Namespace) -> int:
    try:
        from kerneleval.mcp_server import serve
    except ImportError as e:
        print(f"error: kerneleval mcp needs the mcp extra ({e}): "
              "pip install 'kerneleval-client[mcp]'", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return serve(
        resolve_address(a.address),
        admin_token=admin_token(a),
        credentials=credentials(a),
        http_port=a.http_port,
        http_host=a.http_host,
        tenant_token=tenant_token(a),
    )


TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def cmd_tenant_token(a: argparse.Namespace) -> int:
    """A new token for tenant NAME (stdout, line 1) and its line for --tenants-file (line 2,
    the token's sha256: the file never holds the token)."""
    if not TENANT_NAME.fullmatch(a.name):
        print(f"error: tenant name {a.name!r}: letters, digits, '_', '.', '-' (1-64)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    token = "ket_" + secrets.token_urlsafe(32)
    print(token)
    print(f"{a.name}:{hashlib.sha256(token.encode()).hexdigest()}")
    return 0


def _error_text(e: errors.KernelEvalError, address: str, token_given: bool = False) -> str:
    text = f"error: {e}"
    if e.code == grpc.StatusCode.UNAVAILABLE and "serve" not in text:
        text += f"\n(is the server running at {address}? start one with `kerneleval serve`)"
    hint = flag_hint(v.field for v in e.field_violations)
    if hint:
        text += f"\n({hint}; see `kerneleval evaluate --help`)"
    # (A service with tenants says itself what a KernelEvalService call lacks.)
    if e.code == grpc.StatusCode.UNAUTHENTICATED and not token_given and "tenant" not in text:
        text += (
            "\n(no admin token was given: the service's is in the file admin_token of its "
            f"state folder: --admin-token-file STATE_DIR/admin_token, --admin-token TOKEN or "
            f"${ADMIN_TOKEN_ENV})"
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    hide_secrets(args_list)
    parser = build_parser()
    # `serve` hands every argument after it to the server's own parser.
    if "serve" in args_list:
        i = args_list.index("serve")
        head = parser.parse_args([*args_list[:i], "serve"])
        if head.command == "serve":
            return cmd_serve(args_list[i + 1 :])
    a = parser.parse_args(args_list)
    if a.command == "mcp":
        return cmd_mcp(a)
    if a.command == "tenant-token":
        return cmd_tenant_token(a)
    address = resolve_address(a.address)
    out: Output | None = None
    try:
        out = Output(a)
        with Client(
            address,
            timeout=a.timeout,
            admin_token=admin_token(a),
            credentials=credentials(a),
            reconnect_timeout=a.reconnect_timeout,
            tenant_token=tenant_token(a),
        ) as c:
            return int(a.func(a, c, out))
    except errors.KernelEvalError as e:
        if out is not None:
            out.close()  # the error goes below the bars, not into them
        token_given = bool(admin_token(a))
        print(render.printable(_error_text(e, address, token_given)), file=sys.stderr)
        return EXIT_SERVICE
    except gpumode.TaskError as e:
        print(f"error: not a GPU MODE task: {e}\n(a task folder holds reference.py and "
              "task.yml, as gpu-mode/reference-kernels; see `kerneleval gpumode --help`)",
              file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    except (OSError, ValueError, json_format.ParseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if out is not None:
            out.close()
