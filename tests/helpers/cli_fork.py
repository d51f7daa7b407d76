"""The real ``ray-mesh`` CLI, one fresh process per call, for the price of one import.

Each bad-input case used to be ``python -m ray_mesh.cli`` in a new interpreter: ~4-6 s each
on a 2-core machine, nearly all of it importing torch and Ray. Here one server process
imports :mod:`ray_mesh.cli.main` once; every call forks it, and the child does what
``python -m ray_mesh.cli ARGS`` does (``sys.exit(main(ARGS))``) in the call's folder and
environment, with file descriptors 1 and 2 on a file (so argparse, logging and tracebacks
are all caught), and its exit status is the call's. A fork has its own memory, so nothing a
case does reaches the next one; a call past its time limit is killed (a hang guard).

``CliServer().run(args, cwd, env, timeout_s)`` returns a ``subprocess.CompletedProcess``
like ``subprocess.run(..., capture_output=True, text=True)`` (output in ``stdout``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child(req: dict, out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    code = 1
    try:
        from ray_mesh.cli.main import main

        sys.argv = ["ray-mesh", *req["args"]]
        ret = main(req["args"])
        code = 0 if ret is None else ret
    except SystemExit as exc:  # argparse's errors, as the real command exits
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - an uncaught error prints its traceback, rc 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        code = code if isinstance(code, int) and not isinstance(code, bool) else 1
        # What the child itself meant to exit with, beside its output: the server checks
        # the two agree (a lost output file or a stray exit status is named, not passed on).
        # A failed write must not raise here: the fork would go on as a second server.
        with contextlib.suppress(OSError):  # the server then says "returned None"
            Path(out_path + ".code").write_text(str(code))
        os._exit(code)


def serve() -> None:
    """One JSON request per stdin line -> one JSON reply per stdout line."""
    import ray_mesh.cli.main  # noqa: F401 - the import every call would otherwise pay

    replies = os.fdopen(os.dup(1), "w")
    folder = tempfile.mkdtemp(prefix="cli_fork_")  # this server's own: no shared /tmp names
    print("READY", file=replies, flush=True)
    for n, line in enumerate(sys.stdin):
        req = json.loads(line)
        out_path = os.path.join(folder, f"call{n}.out")
        pid = os.fork()
        if pid == 0:
            _child(req, out_path)
        deadline = time.monotonic() + req["timeout_s"]
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        out_file, code_file = Path(out_path), Path(out_path + ".code")
        out = out_file.read_text(errors="replace") if out_file.exists() else None
        meant = int(code_file.read_text()) if code_file.exists() else None
        out_file.unlink(missing_ok=True)
        code_file.unlink(missing_ok=True)
        rc = None if status is None else os.waitstatus_to_exitcode(status)
        print(json.dumps({"rc": rc, "out": out, "meant": meant, "pid": pid}), file=replies,
              flush=True)
    shutil.rmtree(folder, ignore_errors=True)


class CliServer:
    """The test side: starts :func:`serve` in a subprocess on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"))
                                            if p)
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError("the CLI fork server did not start")
        return proc

    def run(self, args: list[str], cwd: Path | str, env: dict[str, str],
            timeout_s: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"args": args, "cwd": str(cwd), "env": env,
                                          "timeout_s": timeout_s}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        if reply["rc"] is None:
            raise subprocess.TimeoutExpired(["ray-mesh", *args], timeout_s, reply["out"])
        if reply["out"] is None or reply["meant"] != reply["rc"]:
            # Not the command's doing: its output file is gone, or the process exited with
            # a status the command did not return (killed, or exited from elsewhere).
            raise RuntimeError(f"the forked call ray-mesh {' '.join(args)} (pid {reply['pid']}) "
                               f"exited {reply['rc']}, returned {reply['meant']}, output file "
                               f"{'missing' if reply['out'] is None else 'kept'}: "
                               f"{(reply['out'] or '')[-2000:]!r}")
        return subprocess.CompletedProcess(["ray-mesh", *args], reply["rc"], reply["out"], "")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    serve()
