"""Bad input that only the nodes can see, under real Ray: an interface the nodes do not have
(``network.interface``), a ``GLOO_SOCKET_IFNAME`` the user set on the workers, and DiLoCo
over ``dp_replicate: nodes`` on a one-node cluster (one replica). All fail
at bring-up, before any process group, with our own one-line error, not Ray Train's
``ControllerError`` wrapper and its traceback.

The driver is a subprocess joining the session's Ray by address (not embedded), so the
driver-side shortcut for an embedded Ray (tests/unit/test_bad_inputs_cli.py) does not apply
and the check on the workers is what refuses the job.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = "name: {name}\ntrain: t.py:train_loop\nscaling: {{num_workers: 2}}\n{extra}"


def _driver(tmp_path: Path, gcs: str, name: str, extra: str, env_vars: dict[str, str],
            body: str = "pass") -> subprocess.CompletedProcess:
    (tmp_path / "t.py").write_text(f"def train_loop(config):\n    {body}\n")
    (tmp_path / "job.yaml").write_text(JOB.format(name=name, extra=extra))
    # ray.init with a runtime_env: how a user's variable reaches workers on a cluster.
    code = (
        "import sys, ray\n"
        "from ray_mesh.cli.main import main\n"
        f"ray.init(address={gcs!r}, runtime_env={{'env_vars': {env_vars!r}}}, "
        "log_to_driver=True)\n"
        f"sys.exit(main(['run', 'job.yaml', '--address', {gcs!r}]))\n")
    env = {**os.environ, "RAY_ADDRESS": gcs}  # Ray's own helpers (state API) use it too
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"  # the controller's poll: 2 s by default
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def _one_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    out = proc.stdout + proc.stderr
    errors = [x for x in out.splitlines() if x.startswith("ray-mesh: error:")]
    assert proc.returncode == 2, out[-4000:]
    assert len(errors) == 1, out[-4000:]
    assert "ControllerError" not in errors[0], errors[0]
    for word in words:
        assert word in errors[0], (word, errors[0])
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name, extra, env_vars, words", [
    ("iface", "network: {interface: nosuch0}\n", {},
     ["nosuch0", "does not exist", "'auto'"]),
    # slow tier (~20 s): the same node-side check as "iface"; the driver-side refusal of a
    # user-set GLOO_SOCKET_IFNAME is in tests/unit/test_bad_inputs_cli.py (default tier)
    pytest.param("gloo", "", {"GLOO_SOCKET_IFNAME": "nosuch0"},
                 ["GLOO_SOCKET_IFNAME=nosuch0", "set by the user", "Unset GLOO_SOCKET_IFNAME"],
                 marks=pytest.mark.slow),
    # slow tier (~20 s): the layout's rule on the dims as sized (check_resolved, its logic in
    # tests/unit/test_topology.py, default tier): 'nodes' on the one node of this cluster
    pytest.param("diloco", "mesh: {dp_replicate: nodes, dp_shard: -1}\n"
                 "replicate: {mode: diloco, every: 4}\n", {},
                 ["dp_replicate=nodes,dp_shard=-1 comes to dp_shard=2", "(1 node(s)",
                  "dp_replicate: 2 (two replicas on one node)"], marks=pytest.mark.slow),
], ids=["interface", "user-gloo-ifname", "diloco-one-replica"])
def test_nodes_refuse_an_interface_they_do_not_have(ray_local, tmp_path, name, extra,
                                                    env_vars, words):
    import ray

    gcs = ray.get_runtime_context().gcs_address
    out = _one_line(_driver(tmp_path, gcs, name, extra, env_vars), *words)
    # Not our error's traceback (the controller logs it as one line too). Ray Train's own
    # shutdown noise on a loaded machine (its autoscaling coordinator) is not ours to hide.
    ours = [x for x in out.splitlines() if 'File "' in x and "ray_mesh" in x]
    assert not ours, out[-4000:]


@pytest.mark.slow  # ~15 s; the line's text: tests/unit/test_bad_inputs_preray.py (default tier)
@pytest.mark.timeout(600)
def test_a_train_function_that_raises_ends_in_one_line_naming_its_ranks(ray_local, tmp_path):
    """The user's own error: each rank's traceback (Ray's), then one closing line naming
    the ranks and the error, exit status 1, not the driver's traceback through ray_mesh and
    Ray Train."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    proc = _driver(tmp_path, gcs, "raises", "", {}, body='raise ValueError("bad batch at step 3")')
    out = proc.stdout + proc.stderr
    closing = [x for x in out.splitlines() if x.startswith("ray-mesh:")]
    assert proc.returncode == 1, out[-4000:]  # the run failed (as a replica group's would)
    # the ranks Ray Train had heard from when it stopped the run: 0, or both
    assert len(closing) == 1 and re.fullmatch(
        r"ray-mesh: run 'raises' failed: its train function raised on (rank 0|rank 1|ranks 0, "
        r"1): ValueError: bad batch at step 3 \(each rank's traceback is above\)",
        closing[0]), out[-4000:]
    assert 'File "' in out and "t.py" in out, out[-4000:]  # the rank's traceback is shown
    assert not [x for x in out.splitlines() if 'File "' in x and "ray_mesh" in x], out[-4000:]
