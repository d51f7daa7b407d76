"""``ray-mesh storage serve``: an S3-compatible server for a home lab, in one command.

A multi-node run needs storage every node can write (Ray records a checkpoint once every rank
reported it, and a restarted worker may land on another node). Without NFS or a cloud bucket,
this serves one: moto's S3 server (``moto[server]``, the one Ray's own storage tests use),
bound to an address the nodes reach (the head's tailnet address), with the bucket created.
It keeps objects **in memory**: they are gone when it stops. For anything that must outlive
the process, use MinIO or a cloud bucket; the job settings are the same
(``storage_path: s3://BUCKET/runs``, ``storage_endpoint: http://HOST:PORT``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from typing import Any

from ray_mesh.core.object_store import bucket_problem
from ray_mesh.errors import StorageError, StorageURIError

START_TIMEOUT_S = 30.0
READY = "ray-mesh storage: serving"
"""The first word of the line printed once the server answers (scripts wait for it)."""


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise StorageError(
                f"ray-mesh storage serve: cannot listen on {host}:{port}: {exc.strerror or exc}"
                f". Pick another --port, or an address of this machine for --host (e.g. its "
                f"tailnet address, or 127.0.0.1 for one machine).") from None


def start_server(host: str, port: int, bucket: str,
                 timeout_s: float = START_TIMEOUT_S) -> Any:
    """Start moto's S3 server on ``host:port`` with ``bucket`` created; returns the server
    (``.stop()`` ends it). Bounded: raises :class:`StorageError` when it does not answer."""
    why = bucket_problem(bucket)
    if why:
        raise StorageURIError(f"--bucket: {why}.")
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise StorageError(
            "ray-mesh storage serve needs moto's S3 server: pip install 'moto[server]>=5.2.5' "
            "(a lab server; in production use MinIO or a cloud bucket).") from None
    _check_port_free(host, port)
    server = ThreadedMotoServer(ip_address=host, port=port, verbose=False)
    starter = threading.Thread(target=server.start, daemon=True, name="ray_mesh-moto-start")
    starter.start()
    starter.join(timeout_s)
    if starter.is_alive():
        raise StorageError(f"ray-mesh storage serve: the S3 server on {host}:{port} did not "
                           f"start within {timeout_s:g} s.")
    import pyarrow.fs

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # Explicit lab keys: moto checks none, and an anonymous upload would be stored framed.
    fs = pyarrow.fs.S3FileSystem(endpoint_override=where, scheme="http", access_key="lab",
                                 secret_key="lab", allow_bucket_creation=True,
                                 connect_timeout=5, request_timeout=10)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fs.create_dir(bucket)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                server.stop()
                raise StorageError(f"ray-mesh storage serve: could not create bucket "
                                   f"{bucket!r} on {where}: {exc}") from None
            time.sleep(0.2)
    return server


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = start_server(args.host, args.port, args.bucket)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    print(f"{READY} {url}, bucket {args.bucket} (moto, in memory: objects are lost when this "
          f"stops; Ctrl-C stops it)\n"
          f"  job file:  run: {{storage_path: s3://{args.bucket}/runs, storage_endpoint: "
          f"{url}}}\n"
          f"  or:        ray-mesh run JOB --storage-path s3://{args.bucket}/runs "
          f"--storage-endpoint {url}\n"
          f"  every node and the driver: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY set "
          f"(any values for this server)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    server.stop()
    print("ray-mesh storage: stopped", file=sys.stderr, flush=True)
    return 0


def add_parser(sub: Any) -> None:
    """``ray-mesh storage serve`` under the CLI's subcommands."""
    from ray_mesh.cli.flags import name_flag, port_flag

    storage = sub.add_parser("storage", help="object storage for checkpoints (a lab S3 server)")
    verbs = storage.add_subparsers(dest="verb", required=True)
    serve = verbs.add_parser(
        "serve", help="run an S3-compatible server (moto) with a bucket, until Ctrl-C",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    serve.add_argument("--host", default="127.0.0.1", type=name_flag,
                       help="address to listen on: one every node reaches, e.g. the head's "
                            "tailnet address (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=port_flag, default=9000, help="port (default 9000)")
    serve.add_argument("--bucket", default="ray-mesh", type=name_flag,
                       help="bucket to create (default ray-mesh)")
    serve.set_defaults(func=_cmd_serve)


__all__ = ["READY", "START_TIMEOUT_S", "add_parser", "start_server"]
