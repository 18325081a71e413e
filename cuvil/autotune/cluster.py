"""The cluster commands: ``cuvil scheduler``, ``cuvil worker`` (a board joins) and ``cuvil cluster status``.

    cuvil scheduler [--host H] [--port 8786] [--tls-ca-file F --tls-cert F --tls-key F] [--insecure]
    cuvil worker tls://host:8786 --board NAME [--threads N] [tls options] [--insecure] [--exec "PREFIX"]
    cuvil cluster status tls://host:8786 [tls options] [--json]

They are Dask's scheduler and worker with cuvil's defaults (:data:`SCHEDULER_CONFIG`): a worker that stops
answering is dropped within 30 s, a task no connected board can take fails after 10 s instead of waiting
for one forever, and a task whose board died under it is tried on one other board, then fails.  A worker
runs in the command's own process (no nanny that restarts it behind the tuner's back), with one Dask
thread and the resource ``cuvil-board-NAME=1``; what its tasks run is :func:`cuvil.autotune.board.measure`.

Anyone who can submit a task to the scheduler runs code on every board.  So both commands refuse to
listen on, or connect to, an address beyond this machine's loopback without TLS (mutual: each side shows
a certificate signed by the cluster's CA) unless ``--insecure`` says that is meant; see docs/boards.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import signal
import socket
import sys
from typing import Any

from cuvil.errors import ArgumentError, CuvilError

SCHEDULER_CONFIG: dict[str, Any] = {
    "distributed.scheduler.worker-ttl": "30s",  # a board silent this long (dead, unplugged) is dropped
    "distributed.scheduler.no-workers-timeout": "10s",  # a task no board can take fails, not waits
    "distributed.scheduler.allowed-failures": 1,  # a board died under a task: one other board, then "lost"
}
DEFAULT_PORT = 8786


def dispatch(args: argparse.Namespace) -> int | None:
    """Run a cluster command (its flags: :func:`cuvil.cli.parser.build_parser`); None when ``args`` is another
    command's."""
    if args.cmd == "scheduler":
        return run_scheduler(args)
    if args.cmd == "worker":
        return run_worker(args)
    if args.cmd == "cluster":
        if args.cluster_cmd == "status":
            return status(args)
        raise ArgumentError("cuvil cluster: say what, e.g. cuvil cluster status tls://host:8786")
    return None


# -- security ---------------------------------------------------------------------------------------
def security(args: argparse.Namespace, role: str) -> Any:
    """A Dask Security for ``role`` ("scheduler", "worker", "client") from the TLS options, or None."""
    files = {"--tls-ca-file": args.tls_ca_file, "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    given = [k for k, v in files.items() if v]
    if not given:
        return None
    if len(given) < 3:
        missing = ", ".join(k for k in files if k not in given)
        raise ArgumentError(f"TLS needs all three of --tls-ca-file, --tls-cert and --tls-key; missing {missing}")
    for flag, path in files.items():
        if not os.path.isfile(path):
            raise ArgumentError(f"{flag} {path!r}: no such file")
    from distributed.security import Security

    return Security(tls_ca_file=args.tls_ca_file, require_encryption=True,
                    **{f"tls_{role}_cert": args.tls_cert, f"tls_{role}_key": args.tls_key})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) means only this machine."""
    if not host:
        return False  # all interfaces
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def _plain_refused(what: str, host: str) -> ArgumentError:
    return ArgumentError(
        f"{what} {host or 'all interfaces'} is beyond this machine, and without TLS anyone who can reach it can run "
        "code on every board (the boards run what they are sent): give --tls-ca-file, --tls-cert and --tls-key "
        "(docs/boards.md says how to make them), or --insecure if that is meant (a private, trusted network)")


def split_address(address: str, tls: bool) -> tuple[str, str, int]:
    """(scheme, host, port) of a scheduler address; no scheme means tls:// with TLS options, else tcp://."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = ("tls" if tls else "tcp"), address
    if scheme not in ("tcp", "tls"):
        raise ArgumentError(f"scheduler address {address!r}: use tls://HOST:PORT (or tcp:// on loopback)")
    host, _, port = rest.rpartition(":")
    if not host:
        host, port = rest, str(DEFAULT_PORT)
    try:
        return scheme, host.strip("[]"), int(port)
    except ValueError:
        raise ArgumentError(f"scheduler address {address!r}: the port {port!r} is not a number") from None


def connect_address(args: argparse.Namespace, sec: Any) -> str:
    scheme, host, port = split_address(args.address, sec is not None)
    if scheme == "tls" and sec is None:
        raise ArgumentError(f"{args.address} is a TLS address: give --tls-ca-file, --tls-cert and --tls-key")
    if scheme == "tcp" and sec is not None:
        raise ArgumentError(f"{args.address} is plain TCP but TLS files were given: write tls://{host}:{port}")
    if scheme == "tcp" and not is_loopback(host) and not args.insecure:
        raise _plain_refused("the scheduler at", host)
    return f"{scheme}://{host}:{port}" if ":" not in host else f"{scheme}://[{host}]:{port}"


# -- the commands ------------------------------------------------------------------------------------
def _serve(make: Any, ready: Any) -> int:
    """Start the server ``make()`` returns (a Dask Scheduler or Worker, made inside the event loop), print
    what ``ready`` says, run until it closes or SIGINT / SIGTERM arrives."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = make()
        async with server:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.close()))
            print(ready(server), flush=True)
            await server.finished()

    asyncio.run(main())
    return 0


def run_scheduler(args: argparse.Namespace) -> int:
    import dask
    from distributed import Scheduler

    sec = security(args, "scheduler")
    if sec is None and not is_loopback(args.host) and not args.insecure:
        raise _plain_refused("listening on", args.host)
    config = dict(SCHEDULER_CONFIG)
    config["distributed.scheduler.worker-ttl"] = args.worker_ttl
    config["distributed.scheduler.no-workers-timeout"] = args.no_workers_timeout
    with dask.config.set(config):
        return _serve(lambda: Scheduler(host=args.host or None, port=args.port, protocol="tls" if sec else "tcp",
                                        security=sec, dashboard=False, dashboard_address=None),
                      lambda s: f"cuvil scheduler: listening at {s.address} (worker TTL {args.worker_ttl}, "
                      f"tasks no board can take fail after {args.no_workers_timeout})")


def run_worker(args: argparse.Namespace) -> int:
    from distributed import Worker

    from cuvil.autotune import board

    sec = security(args, "worker")
    address = connect_address(args, sec)
    if args.threads < 1:
        raise ArgumentError(f"--threads {args.threads}: the kernels need at least one thread")
    cfg = board.configure(args.board, args.threads, args.exec_prefix)
    f = board.facts(cfg)  # an exec board's facts are read now, before the worker joins
    host = args.host
    if host is None and is_loopback(split_address(address, sec is not None)[1]):
        host = "127.0.0.1"
    if host is not None and sec is None and not is_loopback(host) and not args.insecure:
        raise _plain_refused("listening on", host)
    name = f"{cfg.name}-{socket.gethostname()}-{os.getpid()}"
    return _serve(lambda: Worker(address, nthreads=1, resources={cfg.resource: 1}, security=sec, host=host,
                                 port=args.port or None, protocol="tls" if sec else "tcp", memory_limit=0,
                                 death_timeout=args.death_timeout, dashboard=False, name=name),
                  lambda w: f"cuvil worker: board {cfg.name} ({summary(f)}) at {w.address}, scheduler "
                  f"{address}")


def summary(f: dict[str, Any] | None) -> str:
    """One line of a board's facts: architecture, ISA, cores, caches, kernel threads, versions."""
    if not f:
        return "facts unknown"
    feats = set(f.get("cpu_features") or ())
    isa = next((n for flag, n in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON"),
                                  ("neon", "NEON"), ("sse4_2", "SSE4.2")) if flag in feats), "")
    caches = f.get("caches") or {}
    kib = ", ".join(f"{k} {v >> 10} KiB" for k, v in caches.items() if v)
    parts = [f"{f.get('arch')}" + (f" {isa}" if isa else ""), f"{f.get('cores')} cores", kib,
             f"{f.get('threads')} kernel thread(s)", f"cuvil {f.get('cuvil')}", f"numpy {f.get('numpy')}"]
    if f.get("governor"):
        parts.append(f"governor {f['governor']}")
    if f.get("exec"):
        parts.append(f"exec {f['exec']!r}")
    return ", ".join(p for p in parts if p)


def status(args: argparse.Namespace) -> int:
    from distributed import Client

    from cuvil.autotune import board

    sec = security(args, "client")
    address = connect_address(args, sec)
    try:
        client = Client(address, security=sec, timeout=args.timeout)
    except (OSError, TimeoutError) as exc:
        hint = " (check the certificates: the scheduler refuses one its CA did not sign)" if sec else ""
        raise CuvilError(f"cannot reach the scheduler at {address} within {args.timeout:g} s{hint}: {exc}") from None
    with client:
        found = board.boards(client, args.board)
    if args.json:
        json.dump(found, sys.stdout, indent=1, default=str)
        print()
        return 0
    if not found:
        print(f"no boards at {address}" + (f" of kind {args.board}" if args.board else ""))
        return 0
    print(f"{len(found)} board(s) at {address}")
    for b in found:
        state = f"busy ({b['tasks']} task(s))" if b["busy"] else "idle"
        print(f"  {b['board']:<12} {b['address']:<28} {state:<16} {summary(b['facts']) if b['facts'] else b['error']}")
    return 0
