"""``ray-mesh storage serve``: an S3-compatible server for a home lab, in one command.

A multi-node run needs storage every node can write (Ray records a checkpoint once every rank
reported it, and a restarted worker may land on another node). Without NFS or a cloud bucket,
this serves one: moto's S3 server (``moto[server]``, the one Ray's own storage tests use),
bound to an address the nodes reach (the head's tailnet address), with the bucket created.
It keeps objects **in memory**: they are gone when it stops. For anything that must outlive
the process, use MinIO or a cloud bucket; the job settings are the same
(``storage_path: s3://BUCKET/runs``, ``storage_endpoint: http://HOST:PORT``).

It serves the S3 API only, to requests signed with its own key: made at the first start,
printed once and kept in a private key file (``--key-file``, default
``~/.ray_mesh/storage.env``; export it on every node and the driver). moto alone would answer
anyone, its admin API included (a reset wipes every bucket): ``storage_guard`` says why and
how.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ray_mesh.cli.storage_guard import DEFAULT_KEY_FILE, Key, SignedS3Only, load_or_make_key
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


class Server:
    """moto's S3 app behind :class:`~ray_mesh.cli.storage_guard.SignedS3Only`, served by
    werkzeug on threads (what moto's ``ThreadedMotoServer`` does, with no other service)."""

    def __init__(self, host: str, port: int, key: Key, made: bool = False) -> None:
        from moto.server import MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.key, self.made = key, made  # made: the key was made by this start
        self._server = make_server(host, port, SignedS3Only(create_backend_app("s3"), key),
                                   threaded=True, request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="ray_mesh-storage-serve")
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join(10)


def _already_ours(exc: Exception) -> bool:
    """The bucket exists and is this key's (a retried create whose first answer was lost)."""
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code == "BucketAlreadyOwnedByYou"


def start_server(host: str, port: int, bucket: str, key_file: str = DEFAULT_KEY_FILE,
                 timeout_s: float = START_TIMEOUT_S) -> Server:
    """Serve moto's S3 API on ``host:port`` with ``bucket`` created, to requests signed with
    the key of ``key_file`` (made there if missing); returns the server (``.stop()`` ends
    it). Bounded: raises :class:`StorageError` when it does not answer."""
    why = bucket_problem(bucket)
    if why:
        raise StorageURIError(f"--bucket: {why}.")
    try:
        import moto.server  # noqa: F401 - moto[server]: flask and werkzeug with it
    except ImportError:
        raise StorageError(
            "ray-mesh storage serve needs moto's S3 server: pip install 'moto[server]>=5.2.5' "
            "(a lab server; in production use MinIO or a cloud bucket).") from None
    _check_port_free(host, port)
    key, made = load_or_make_key(key_file)
    server = Server(host, port, key, made)
    # boto3 (moto's own dependency), not pyarrow: a pyarrow S3FileSystem made in this
    # process can deadlock its exit (pyarrow's S3 finalizer at interpreter shutdown,
    # apache/arrow#50188), and a server that does not stop on SIGTERM is a hang.
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    s3 = boto3.client("s3", endpoint_url=f"http://{where}", aws_access_key_id=key[0],
                      aws_secret_access_key=key[1], region_name="us-east-1",
                      config=Config(connect_timeout=5, read_timeout=10,
                                    retries={"max_attempts": 1}))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            s3.create_bucket(Bucket=bucket)
            break
        except (BotoCoreError, ClientError) as exc:  # not answering yet, or refused: bounded
            if _already_ours(exc):
                break
            if time.monotonic() > deadline:
                server.stop()
                raise StorageError(f"ray-mesh storage serve: could not create bucket "
                                   f"{bucket!r} on {where}: {exc}") from None
            time.sleep(0.2)
    return server


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig()  # the guard's refusals, one line each
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    stop = threading.Event()  # set before the banner: a script may stop it as soon as it reads it
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = start_server(args.host, args.port, args.bucket, args.key_file)
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{args.port}"
    key_file = Path(args.key_file).expanduser()
    # The key is printed once, when it is made; later starts name the file only.
    key = (f"made now and kept in {key_file} (mode 0600): `. {key_file}`, or\n"
           f"    export AWS_ACCESS_KEY_ID={server.key[0]} AWS_SECRET_ACCESS_KEY={server.key[1]}"
           if server.made else f"the one in {key_file} (`. {key_file}`)")
    print(f"{READY} {url}, bucket {args.bucket} (moto's S3 API only, signed requests only; in "
          f"memory: objects are lost when this stops; Ctrl-C stops it)\n"
          f"  job file:  run: {{storage_path: s3://{args.bucket}/runs, storage_endpoint: "
          f"{url}}}\n"
          f"  or:        ray-mesh run JOB --storage-path s3://{args.bucket}/runs "
          f"--storage-endpoint {url}\n"
          f"  every node and the driver (before `ray start`): this server's key, {key}",
          flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()
    print("ray-mesh storage: stopped", file=sys.stderr, flush=True)
    return 0


def _cmd_key(args: argparse.Namespace) -> int:
    """``ray-mesh storage key``: the server's key made now (printed once), for nodes that
    must have it in their environment before Ray starts, i.e. before the server runs."""
    (key_id, secret), made = load_or_make_key(args.key_file)
    path = Path(args.key_file).expanduser()
    print(f"ray-mesh storage: key made, kept in {path} (mode 0600); every node and the "
          f"driver: `. {path}` before `ray start`, or:\n    export AWS_ACCESS_KEY_ID={key_id} "
          f"AWS_SECRET_ACCESS_KEY={secret}" if made else
          f"ray-mesh storage: the key in {path} (made earlier; delete it for a new one)")
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
    key = verbs.add_parser("key", help="make the server's key now (before `ray start` on "
                           "the nodes), or say where it is")
    for verb in (serve, key):
        verb.add_argument("--key-file", default=DEFAULT_KEY_FILE, type=name_flag,
                          help="the server's key (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY): "
                               "read from this private file, or made and written there (0600) "
                               f"when it does not exist (default {DEFAULT_KEY_FILE})")
    serve.set_defaults(func=_cmd_serve)
    key.set_defaults(func=_cmd_key)
