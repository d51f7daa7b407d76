"""A real S3-compatible server process for the tests: moto, as a user starts it.

:class:`S3Server` runs ``python -m ray_mesh.cli storage serve --host H --port P --bucket B
--key-file F`` (the home-lab command of the manual) as a child process, waits for its ready
line (bounded), and stops it with SIGTERM (SIGKILL after a bound). The server answers only
requests signed with its key: the one made at its start (read back from F), or
``credentials`` given (written to F first; :func:`new_credentials` makes a fresh one for
nodes that need it in their environment before the server starts). Its
:attr:`S3Server.credentials` are what a client exports. :class:`AuthS3Server` runs a bare
``moto_server`` that enforces credentials (moto's ``INITIAL_NO_AUTH_ACTION_COUNT``): the
first few requests set up a bucket, a read-write and a read-only IAM user, and from then on
a request with an unknown key, a wrong secret or too little permission is refused, as
MinIO or AWS would.

Credentials: the AWS SDK inside pyarrow uploads anonymously when it has none (which
``ray-mesh storage serve`` refuses); tests of :class:`AuthS3Server` set their keys, and
:data:`FAKE_CREDENTIALS` is for processes that never reach a server with a key of its own.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ports import free_port

REPO = Path(__file__).resolve().parents[2]
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_EC2_METADATA_DISABLED": "true"}
START_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 4  # ports tried when the chosen one is taken where the server listens
KEY_NAMES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def new_credentials() -> dict[str, str]:
    """A fresh key for an :class:`S3Server` started later, as the environment variables a
    client (a node, a driver) exports."""
    from ray_mesh.cli.storage_guard import make_key

    key = make_key()
    return {KEY_NAMES[0]: key[0], KEY_NAMES[1]: key[1], "AWS_EC2_METADATA_DISABLED": "true"}


def _stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)


class S3Server:
    """``ray-mesh storage serve`` in a child process; ``endpoint`` is its URL."""

    def __init__(self, bucket: str = "ray-mesh-test", host: str = "127.0.0.1",
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None,
                 credentials: dict[str, str] | None = None) -> None:
        """``prefix``: a command the server runs under (a virtual node's ``ip netns exec
        ...``: the server then listens inside that node, on ``host``, its address there);
        ``env``: the environment for it (default: this process's); ``credentials``: the key
        it serves (default: the one it makes at start)."""
        from ray_mesh.cli.storage_guard import read_key_file, write_key_file

        self.bucket, self.host = bucket, host
        self.key_dir = Path(tempfile.mkdtemp(prefix="ray_mesh_s3key_"))  # 0700, shared
        key_file = self.key_dir / "storage.env"
        if credentials is not None:
            write_key_file(key_file, (credentials[KEY_NAMES[0]], credentials[KEY_NAMES[1]]))
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        # The port is free here, but the server may listen in another network namespace (a
        # virtual node's), where a Ray process can hold it (seen once: "Address already in
        # use" on the head's tailnet address): another port then, a few times.
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self.endpoint = f"http://{host}:{self.port}"
            self.proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", "ray_mesh.cli", "storage", "serve", "--host",
                 host, "--port", str(self.port), "--bucket", bucket, "--key-file",
                 str(key_file)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
            try:
                self.banner = self._wait_ready()
                break
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                    raise
        key = read_key_file(key_file)
        self.credentials = {KEY_NAMES[0]: key[0], KEY_NAMES[1]: key[1],
                            "AWS_EC2_METADATA_DISABLED": "true"}

    def _wait_ready(self) -> str:
        from ray_mesh.cli.storage import READY

        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:  # a thread: the pipe must keep draining while the server runs
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        seen: list[str] = []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            if line.startswith(READY):
                return "".join(seen)
        _stop(self.proc)
        raise RuntimeError(f"`ray-mesh storage serve` did not get ready within "
                           f"{START_TIMEOUT_S:g} s: {''.join(seen)}")

    def uri(self, path: str = "runs") -> str:
        return f"s3://{self.bucket}/{path}"

    def filesystem(self):
        import pyarrow.fs

        return pyarrow.fs.S3FileSystem(endpoint_override=f"{self.host}:{self.port}",
                                       scheme="http", access_key=self.credentials[KEY_NAMES[0]],
                                       secret_key=self.credentials[KEY_NAMES[1]])

    def stop(self) -> None:
        _stop(self.proc)
        shutil.rmtree(self.key_dir, ignore_errors=True)


class BareS3Server:
    """A bare ``moto_server`` that checks nothing, with ``bucket`` created: a server that
    stores what an anonymous upload sends (its aws-chunked framing included), for the
    storage check's read-back (``ray-mesh storage serve`` refuses anonymous requests)."""

    def __init__(self, bucket: str = "bare-bucket") -> None:
        import boto3

        moto = shutil.which("moto_server")
        if moto is None:
            raise RuntimeError("moto_server is not installed: pip install 'moto[server]'")
        self.bucket, self.port = bucket, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            s3 = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                              aws_access_key_id="bare", aws_secret_access_key="bare")
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    s3.create_bucket(Bucket=bucket)
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise
                    time.sleep(0.2)
        except BaseException:
            _stop(self.proc)
            raise

    def uri(self, path: str = "runs") -> str:
        return f"s3://{self.bucket}/{path}"

    def stop(self) -> None:
        _stop(self.proc)


class AuthS3Server:
    """A ``moto_server`` that checks credentials, with a bucket and two users set up.

    ``rw`` and ``ro`` are (access key id, secret) pairs: one may read and write the bucket,
    the other only read it.
    """

    SETUP_ACTIONS = 7  # create_bucket, 2 x (create_user, put_user_policy, create_access_key)

    def __init__(self, bucket: str = "locked-bucket") -> None:
        import boto3

        moto = shutil.which("moto_server")
        if moto is None:
            raise RuntimeError("moto_server is not installed: pip install 'moto[server]'")
        self.bucket, self.port = bucket, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [moto, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(self.SETUP_ACTIONS)})
        try:
            kw = {"endpoint_url": self.endpoint, "region_name": "us-east-1",
                  "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
            s3, iam = boto3.client("s3", **kw), boto3.client("iam", **kw)
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                try:
                    s3.create_bucket(Bucket=bucket)
                    break
                except Exception:  # noqa: BLE001 - not listening yet
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise
                    time.sleep(0.2)
            self.rw = self._user(iam, "rw", ["s3:*"])
            self.ro = self._user(iam, "ro", ["s3:GetObject", "s3:ListBucket"])
        except BaseException:
            _stop(self.proc)
            raise

    def _user(self, iam, name: str, actions: list[str]) -> tuple[str, str]:
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName=name, PolicyDocument=json.dumps(
            {"Version": "2012-10-17",
             "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def stop(self) -> None:
        _stop(self.proc)
