"""``polyspec serve DIR``: an OpenAI-compatible HTTP API over a validated chain folder (see docs/SERVE.md).

This module stays light (argparse, sockets): fastapi, uvicorn and torch are imported only when a server is built, so
``polyspec --help`` does not pay for them. The app itself lives in :mod:`polyspec.decode.serve.app`, the wire format
in :mod:`polyspec.decode.serve.api`, the Prometheus counters in :mod:`polyspec.decode.serve.metrics`, the load limits
(queue, deadline, prompt length, read timeout, connections) in :mod:`polyspec.decode.serve.limits`, who may talk
to it (Host names, web origins) in :mod:`polyspec.decode.serve.trust`.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

from polyspec.decode.serve.limits import ServeLimits
from polyspec.decode.serve.trust import ServeAccess, guarded_protocol, is_loopback
from polyspec.errors import PolyspecError, missing_extra
from polyspec.modes import MODES

API_KEY_ENV = "POLYSPEC_API_KEY"


def configure_parser(p: argparse.ArgumentParser) -> None:
    """The arguments of ``polyspec serve``."""
    p.add_argument("chain", type=Path, help="chain folder (with manifest.json); it must validate")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--mode", choices=MODES[::-1], default=None,
                   help="decoding mode (default: the manifest's, or the most levels the chain has)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype of unquantised levels (default: the dtype the chain's profile chose on this kind of "
                        "device, else bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (or set {API_KEY_ENV})")
    p.add_argument("--model-name", default=None, help="the model id clients send and /v1/models lists "
                   "(default: the chain folder's name)")
    p.add_argument("--max-queue", type=int, default=ServeLimits.max_queue,
                   help=f"requests that may wait for the one generation worker; more get 429 with Retry-After "
                   f"(default {ServeLimits.max_queue})")
    p.add_argument("--request-timeout", type=float, default=ServeLimits.request_timeout, metavar="SECONDS",
                   help=f"deadline from a request's arrival (queue wait included): a request still waiting gets 503, "
                   f"a running generation stops with finish_reason 'length' (default {ServeLimits.request_timeout:g}; "
                   "0 = none)")
    p.add_argument("--max-prompt-tokens", type=int, default=ServeLimits.max_prompt_tokens,
                   help=f"longest prompt accepted, in tokens; longer is a 400 "
                   f"(default {ServeLimits.max_prompt_tokens}; 0 = the model's context)")
    p.add_argument("--read-timeout", type=float, default=ServeLimits.read_timeout, metavar="SECONDS",
                   help="seconds a client has to send a request's headers, then its body; slower ones get 408 and "
                   f"are dropped (default {ServeLimits.read_timeout:g})")
    p.add_argument("--max-connections", type=int, default=ServeLimits.max_connections,
                   help=f"connections open at once; one more gets 503 (default {ServeLimits.max_connections})")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a Host name clients may use besides loopback ones (and the --host address); repeat for "
                   "more, '*' for any (a web page reaching the server through its own domain is refused otherwise)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="a web origin (scheme://host[:port]) whose pages may call the API from a browser; repeat for "
                   "more (default none: requests that carry another Origin get 403)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def pick_mode(chain: Any, asked: str | None, manifest_mode: str | None) -> str:
    """``asked`` if given (a chain that cannot run it raises); else the manifest's mode when the chain supports it;
    else the most levels the chain has (chain, dual, ar)."""
    if asked:
        chain.levels_for(asked)
        return asked
    candidates = ([manifest_mode] if manifest_mode else []) + list(MODES[::-1])
    for mode in candidates:
        try:
            chain.levels_for(mode)
            return mode
        except PolyspecError:
            continue
    raise PolyspecError("this chain cannot be decoded in any mode")  # unreachable: ar needs only the target


def build_app(chain_dir: Path, *, mode: str | None = None, device: str = "auto", dtype: str | None = None,
              api_key: str | None = None, model_name: str | None = None, limits: ServeLimits | None = None,
              access: ServeAccess | None = None) -> Any:
    """Validate and load ``chain_dir`` (a chain that does not validate raises PolyspecError) and return the app."""
    try:
        import fastapi  # noqa: F401
    except ImportError:
        raise missing_extra("fastapi", "serve") from None
    from polyspec.decode.generate import load_chain
    from polyspec.decode.serve.app import ServeDefaults, create_app
    from polyspec.manifest import read_manifest

    chain = load_chain(Path(chain_dir), device=device, dtype=dtype)  # validates schema and every sha256 first
    from polyspec.decode import cuda_graphs

    cuda_graphs.prewarm(chain.models.values())  # CUDA: compile the static steps now, not in the first requests
    decode = read_manifest(Path(chain_dir)).decode
    chosen = pick_mode(chain, mode, decode.mode)
    defaults = ServeDefaults(temperature=decode.temperature, top_p=decode.top_p, max_tokens=decode.max_new_tokens)
    name = model_name or Path(chain_dir).resolve().name
    return create_app(chain, mode=chosen, model_name=name, api_key=api_key or None, defaults=defaults,
                      limits=limits, access=access)


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket (IPv4 or IPv6 as ``host`` resolves); a clear PolyspecError when it cannot be had."""
    if not 0 <= port <= 65535:
        raise PolyspecError(f"--port must be in 0..65535, got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PolyspecError(f"cannot resolve --host {host!r}: {exc}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise PolyspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port or stop "
                            "what holds it") from None
    return sock


def make_server(app: Any, *, log_level: str = "info") -> Any:
    """A uvicorn server for ``app`` with its read timeout and connection cap (``app.state.limits``); start it with
    ``server.run(sockets=[bind_socket(...)])``."""
    try:
        import uvicorn
    except ImportError:
        raise missing_extra("uvicorn", "serve") from None
    limits = getattr(app.state, "limits", None) or ServeLimits()
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug", timeout_graceful_shutdown=5,
                            http=guarded_protocol(limits.read_timeout, limits.max_connections))
    return uvicorn.Server(config)


def run(args: argparse.Namespace) -> int:
    """Serve a chain folder over an OpenAI-compatible HTTP API (chat and text completions, streaming, /metrics)."""
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not 0 <= args.port <= 65535:
        raise PolyspecError(f"--port must be in 0..65535, got {args.port}")
    # checked before the chain is loaded
    limits = ServeLimits.from_cli(args.max_queue, args.request_timeout, args.max_prompt_tokens, args.read_timeout,
                                  args.max_connections)
    access = ServeAccess.for_bind(args.host, args.allowed_host, args.cors_origin)
    app = build_app(args.chain, mode=args.mode, device=args.device, dtype=args.dtype, api_key=api_key,
                    model_name=args.model_name, limits=limits, access=access)
    if not is_loopback(args.host) and not api_key:
        print(f"polyspec serve: warning: listening on {args.host}, beyond this machine, with no API key: anyone who "
              f"can reach it can use it. Set --api-key or {API_KEY_ENV}.", file=sys.stderr)
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    state = app.state
    print(f"polyspec serve: {state.model_name} ({state.engine.mode}: {' <- '.join(state.engine.levels)}) on "
          f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1 "
          f"{'(API key required)' if api_key else '(no API key)'}; answers {access.describe()}", file=sys.stderr,
          flush=True)
    server = make_server(app, log_level=args.log_level)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0
