"""The deploy README's Tailscale walkthrough, run line by line on a virtual tailnet.

Two namespace nodes joined by real WireGuard (``wireguard-go``), no shared filesystem, no
Ray started by the harness: the first ``bash`` block of deploy/README.md's "Tailscale"
section is split at its comment headings ("on every box", "head", "each worker", "anywhere
on the tailnet"), the example head address replaced by node 0's tailnet address, and each
part run as a shell script on its box: every box's lines first, then the head's on node 0,
the worker's on node 1, and what runs "anywhere on the tailnet" on node 0. (Not on node 1:
the virtual nodes share one PID namespace, and a Ray 2.60 driver finds "its" raylet by
listing processes, preferring the head's; a driver in node 1 would then talk to node 1's
raylet under the head's identity, and objects it owns could not be found from the head --
an artifact of the harness that separate machines do not have.) The dashboard URL of the
block is opened from node 1, another machine than the head. So the docs cannot
drift from what works: a renamed flag, a step that needs a shared filesystem or a missing
line fails here.

Then what Ray itself gets wrong on a VPN: node 1's Ray restarted with a plain ``ray start
--address=<the head's LAN address>:6379`` (no ``--node-ip-address``; a head hostname that
resolves to the LAN does the same): Ray registers the node under its LAN address, and the
run is refused on the driver before any training worker starts, naming the node and the fix.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from console import problems

from harness.netns import REPO, NetnsCluster, netns_unavailable_reason
from ray_mesh.cli.storage import READY
from ray_mesh.cli.storage_guard import DEFAULT_KEY_FILE, read_key_file

pytestmark = [pytest.mark.ray, pytest.mark.netns]

README = REPO / "deploy" / "README.md"
EXAMPLE_HEAD = "100.101.102.103"
# Until exactly these node addresses are alive (the node that left is gone).
ALIVE = """
import time, ray
ray.init(address={address!r}, log_to_driver=False)
deadline = time.monotonic() + 120
while sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]) != {want!r}:
    if time.monotonic() > deadline:
        raise SystemExit(f"alive: {{[n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]}}")
    time.sleep(0.5)
"""
HEADINGS = {"on every box": "every", "head": "head", "each worker": "worker",
            "anywhere on the tailnet": "anywhere"}


def walkthrough() -> dict[str, list[str]]:
    """The block's commands by heading (comments dropped, continuation lines joined)."""
    text = README.read_text()
    section = text[text.index("## Tailscale"):]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    block = block.replace("\\\n", " ")
    parts: dict[str, list[str]] = {}
    current = None
    for line in block.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            words = re.split(r"[:(]", stripped.lstrip("# "))[0].strip()
            if words in HEADINGS:
                current = HEADINGS[words]
                parts.setdefault(current, [])
            continue
        command = re.sub(r"\s+#.*$", "", stripped)  # an inline comment
        if command:
            assert current, f"a command before any heading in deploy/README.md: {command}"
            parts[current].append(re.sub(r"\s+", " ", command))
    return parts


def test_the_block_has_every_step():
    parts = walkthrough()
    assert set(parts) == set(HEADINGS.values()), parts
    assert any("ray-head.sh" in c for c in parts["head"])
    assert any(c.startswith("ray-mesh storage serve") for c in parts["head"])
    # the bucket's key in Ray's environment: made before the head's Ray, sourced on each box
    assert parts["head"].index("ray-mesh storage key") < parts["head"].index(
        ". ~/.ray_mesh/storage.env") < next(
        i for i, c in enumerate(parts["head"]) if "ray-head.sh" in c)
    for part in ("worker", "anywhere"):
        assert parts[part][0] == ". ~/.ray_mesh/storage.env", parts[part]
    assert any("ray-worker.sh" in c for c in parts["worker"])
    anywhere = " ".join(parts["anywhere"])
    for step in ("ray-mesh doctor", "ray-mesh plan", "ray-mesh run", "examples/driver.py"):
        assert step in anywhere, step


def _script(cluster: NetnsCluster, index: int, lines: list[str], log: Path,
            timeout: float) -> str:
    """Run ``lines`` as one bash script on node ``index`` from the repository root; output to
    a file (a line that leaves a server running in the background keeps its output open)."""
    node = cluster.nodes[index]
    script = "set -euo pipefail\n" + "\n".join(
        x.replace(EXAMPLE_HEAD, cluster.head.ip) for x in lines) + "\n"
    with open(log, "w") as out:
        proc = subprocess.run([*node.exec_prefix(), "bash", "-c", script], cwd=REPO,
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**cluster.node_env(node), "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S":
                                   "0.2"})
    text = log.read_text()
    assert proc.returncode == 0, f"node {index} (rc {proc.returncode}):\n{script}\n{text[-6000:]}"
    return text


@pytest.mark.timeout(900)
def test_deploy_readme_walkthrough_runs_on_the_tailnet(tmp_path):
    if reason := netns_unavailable_reason():
        pytest.fail(f"virtual Tailscale cluster unavailable: {reason}")
    parts = walkthrough()
    t0 = time.monotonic()
    took: dict[str, float] = {}  # seconds per phase, printed at the end

    def lap(name: str) -> None:
        took[name] = round(time.monotonic() - t0 - sum(took.values()), 1)

    with NetnsCluster([{}, {}], start_ray=False) as cluster:
        lap("network")
        head, other = cluster.head.ip, cluster.nodes[1].ip
        up = _script(cluster, 0, parts["every"] + parts["head"], tmp_path / "head.log", 240)
        assert "Ray runtime started" in up, up[-3000:]
        # the bucket server left running in the background says when it serves
        deadline = time.monotonic() + 60
        while READY not in (tmp_path / "head.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        _script(cluster, 1, parts["every"] + parts["worker"], tmp_path / "worker.log", 240)
        cluster.wait_for_nodes(2)
        lap("head and worker up")
        out = _script(cluster, 0, parts["every"] + parts["anywhere"], tmp_path / "any.log",
                      720)
        lap("anywhere block")
        # doctor: both nodes on tailscale0 with their tailnet addresses, the path MTU found
        assert re.search(rf"{re.escape(head)}.*tailscale0", out), out[-6000:]
        assert re.search(rf"{re.escape(other)}.*tailscale0", out), out[-6000:]
        # the CLI run and the python driver both finished, their results in the bucket
        assert "ray-mesh: run 'hsdp' finished at step 40 " in out, out[-6000:]
        assert "driver: finished, results in ray-mesh/runs/hsdp-driver" in out, out[-6000:]
        # a console a person can read (tests/helpers/console.py), the python driver's on a
        # cluster included: its embedded-Ray console is the only one the default tier does
        # not run again (tests/ray/test_console_examples.py, slow tier; the README's main
        # job checks an embedded Ray's)
        bad = problems(out)
        assert not bad, "unexpected console lines:\n" + "\n".join(bad[:40])
        # the dashboard, from the other node, at the block's URL
        url = re.search(r"http://[\d.]+:8265", " ".join(parts["anywhere"]) + README.read_text()
                        ).group(0).replace(EXAMPLE_HEAD, head)
        page = cluster.run_in(1, ["python", "-c", (
            "import sys, urllib.request; r = urllib.request.urlopen(sys.argv[1], timeout=20); "
            "print(r.status, r.read(2000).decode(errors='replace'))"), url], timeout=60)
        assert page.returncode == 0 and page.stdout.startswith("200"), page
        assert "Ray" in page.stdout, page.stdout[:500]

        # What Ray gets wrong on a VPN: node 1 rejoins with a plain `ray start` (no deploy
        # script, no --node-ip-address) naming the head by its LAN address, as a user does
        # whose head's hostname resolves to the LAN. Ray takes the node IP from the route
        # to that address: the LAN's. `ray stop` on that box: its processes only (`ray stop`
        # would stop every Ray process it sees, and the virtual nodes share a process table).
        lap("dashboard page")
        cluster.nodes[1].kill_work()
        lap("node 1 stopped")
        lan, lan1 = cluster.head.lan_ip, cluster.nodes[1].lan_ip
        key = read_key_file(Path(DEFAULT_KEY_FILE).expanduser())  # the block's bucket key
        creds = {"AWS_ACCESS_KEY_ID": key[0], "AWS_SECRET_ACCESS_KEY": key[1]}  # as every box
        rejoin = cluster.run_in(1, ["ray", "start", f"--address={lan}:6379", "--num-cpus=2"],
                                timeout=240, env=creds)
        assert rejoin.returncode == 0, rejoin.stdout + rejoin.stderr
        lap("plain ray start")
        cluster.run_python(ALIVE.format(address=cluster.address, want=sorted([head, lan1])),
                           timeout=150)
        lap("old node gone")
        run = [x for x in parts["anywhere"] if x.startswith("ray-mesh run")][0]
        proc = cluster.run_in(0, ["bash", "-c", "cd " + str(REPO) + " && "
                                  + run.replace(EXAMPLE_HEAD, head)], timeout=300,
                              env=creds)
        lap("run refused")
        print("walkthrough seconds:", took)
        text = proc.stdout + proc.stderr
        errors = [x for x in text.splitlines() if x.startswith("ray-mesh: error:")]
        assert proc.returncode == 2 and len(errors) == 1, text[-6000:]
        assert f"node {lan1}" in errors[0] and f"registered with Ray under {lan1}" in errors[0]
        assert f"tailnet address {other} on tailscale0" in errors[0], errors[0]
        assert "--node-ip-address=$(tailscale ip -4)" in errors[0], errors[0]
        # refused on the driver, from the nodes' probe, before any training worker started
        assert "RayTrainWorker" not in text and "TrainController" not in text, text[-6000:]

