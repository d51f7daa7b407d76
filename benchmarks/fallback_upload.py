"""How long a replica group is held up by a fallback checkpoint into a bucket.

One group of one process (no process group), an MLP of ``--params`` parameters with SGD
momentum (the state list is twice that), a real S3 server (``ray-mesh storage serve``, moto,
in memory, on this machine). For each size, the median of ``--repeat`` saves:

* ``held_s``: what the group waits for with the background upload (the local DCP write and
  the manifest's hashes), ``ray_mesh.replicas.fallback.Fallback.save``;
* ``upload_s``: the upload that then runs beside training (marker last, sizes checked);
* ``inline_s``: what the group would wait for with the upload in line (``held_s +
  upload_s``);
* ``torch_save_s``: the fallback as it was written before (one ``torch.save`` of the list
  into a local directory: no manifest, no upload; for scale).

    python -m benchmarks.fallback_upload --params 1e6 1e7 2.5e7 --repeat 3

The bucket's server is ``benchmarks.wireguard``'s (``ray-mesh storage serve`` with a fresh
key, as the docs start it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import torch


class _Recorder:
    """The coordinator's checkpoint calls, ignored (no quorum: timing only)."""

    def checkpoint_started(self, step: int) -> None: ...
    def checkpointed(self, step: int, path: str) -> None: ...
    def checkpoint_failed(self, gid: int, step: int, error: str) -> None:
        raise RuntimeError(error)


def _state(params: int) -> tuple[list[torch.Tensor], list[None]]:
    from ray_mesh.replicas.state import materialize, tensors_and_likes

    width = max(8, int((params / 2) ** 0.5))
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    materialize(optim)
    return tensors_and_likes(model, optim, None, torch.zeros(3, dtype=torch.int64))


def measure(params: int, repeat: int, bucket: str, endpoint: str) -> dict[str, float]:
    from ray_mesh.replicas.fallback import Fallback

    state, likes = _state(params)
    nbytes = sum(t.numel() * t.element_size() for t in state)
    fallback = Fallback(f"{bucket}/p{params}", _Recorder(), 0, every=1, endpoint=endpoint,
                        keep=1)
    held, uploaded, plain = [], [], []
    for step in range(1, repeat + 1):
        fallback.save(step, state, likes)
        held.append(fallback.held_s)
        fallback.close(timeout_s=600)
        uploaded.append(fallback.uploaded["seconds"])
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            torch.save([t.detach() for t in state], Path(tmp) / "rank0.pt")
            plain.append(time.perf_counter() - t0)
    h, u = statistics.median(held), statistics.median(uploaded)
    return {"params": params, "state_bytes": nbytes,
            "uploaded_bytes": fallback.uploaded["bytes"], "held_s": round(h, 4),
            "upload_s": round(u, 4), "inline_s": round(h + u, 4),
            "torch_save_s": round(statistics.median(plain), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from benchmarks.wireguard import _serve_bucket
    from ray_mesh.cli.storage_guard import make_key, write_key_file

    work = Path(tempfile.mkdtemp(prefix="rmbench_fallback_"))
    key = make_key()  # the server answers requests signed with its key only
    write_key_file(work / "storage.env", key)
    os.environ.update(AWS_ACCESS_KEY_ID=key[0], AWS_SECRET_ACCESS_KEY=key[1],
                      AWS_EC2_METADATA_DISABLED="true")
    server, endpoint, bucket = _serve_bucket(work)
    try:
        for p in args.params:
            print(json.dumps(measure(int(p), args.repeat, bucket, endpoint)), flush=True)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    print(json.dumps({"loadavg": os.getloadavg(), "nproc": os.cpu_count()}))


if __name__ == "__main__":
    main()
