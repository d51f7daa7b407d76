"""The Ray-free core under torchrun: process group -> DeviceMesh with every named dim."""

from __future__ import annotations

import json
import textwrap

import pytest
from torchrun import torchrun

import ray_mesh
from ray_mesh.core.bootstrap import BootstrapError

# One torchrun for the three checks below (each launch of 4 ranks costs ~6 s of the suite's
# 2 cores): a script that inits and shuts down three meshes in turn, then builds the HSDP
# mesh and checks its groups, then checks that shutdown_mesh() frees every group -- last, as
# it needs torch.distributed.fsdp imported only once that mesh is up.
SCRIPT = textwrap.dedent("""
    import json, logging, os, sys
    import torch, torch.distributed as dist
    import ray_mesh

    def gloo_threads():  # the names torch 2.13.0 gives gloo's worker and I/O threads
        names = (open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task"))
        return sorted(n for n in names if "gloo" in n)

    out = {"reinit": []}
    rank = int(os.environ["RANK"])
    # 1. init_mesh again after shutdown_mesh
    for spec in ({"dp_shard": -1}, {"dp_replicate": 2, "dp_shard": -1}, {"dp_shard": 1, "tp": -1}):
        mesh = ray_mesh.init_mesh(spec, timeout_s=30)
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.get_group("dp_shard"))
        dist.all_reduce(t)
        out["reinit"].append(t.item())
        ray_mesh.shutdown_mesh()

    # 2. every named dim's group and a collective on it
    mesh = ray_mesh.init_mesh({"dp_replicate": 2, "dp_shard": -1})
    groups = {"names": list(mesh.mesh_dim_names), "groups": {}, "sums": {}}
    for d in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp"):
        groups["groups"][d] = dist.get_process_group_ranks(mesh.get_group(d))
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group(d))
        groups["sums"][d] = t.item()
    groups["device"] = str(ray_mesh.get_state().device)
    out["groups"] = groups
    ray_mesh.shutdown_mesh()

    # 3. shutdown_mesh frees every group, but one the script keeps, which it names
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("ray_mesh").addHandler(handler)
    mesh = ray_mesh.init_mesh({"dp_replicate": 2, "dp_shard": -1})
    # What a Ray worker does: the train function's module imports FSDP after the mesh is
    # up, and torch.distributed.nn.functional (imported by it) binds group.WORLD -- the dp
    # group here -- as a default argument at import (ray_mesh.core.teardown).
    import torch.distributed.fsdp
    for d in ("dp_replicate", "dp_shard", "dp"):
        dist.all_reduce(torch.ones(1), group=mesh.get_group(d))
    kept = mesh.get_group("dp_replicate") if rank >= 2 else None
    down = {"before": gloo_threads()}
    ray_mesh.shutdown_mesh()  # `mesh` is still referenced, as in most scripts
    down.update(after=gloo_threads(), warnings=warnings)
    del kept  # its last reference: the group is freed now
    down["dropped"] = gloo_threads()
    out["shutdown"] = down
    with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
        json.dump(out, f)
""")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    """Each rank's record of the one torchrun of :data:`SCRIPT`."""
    tmp = tmp_path_factory.mktemp("bootstrap")
    script = tmp / "script.py"
    script.write_text(SCRIPT)
    proc = torchrun(script, str(tmp), nproc=4, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: json.loads((tmp / f"{r}.json").read_text()) for r in range(4)}


def test_torchrun_mesh_groups_and_collectives(ranks):
    for rank, record in ranks.items():
        o = record["groups"]
        assert o["names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
        assert o["device"] == "cpu"
        g = o["groups"]
        assert g["dp_shard"] == ([0, 1] if rank < 2 else [2, 3])
        assert g["dp_replicate"] == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert g["dp"] == g["dp_cp"] == [0, 1, 2, 3]
        assert g["dp_shard_cp"] == g["dp_shard"]
        assert g["tp"] == g["cp"] == g["pp"] == [rank]
        assert o["sums"]["dp_shard"] == sum(g["dp_shard"])
        assert o["sums"]["dp_replicate"] == sum(g["dp_replicate"])
        assert o["sums"]["dp"] == 6.0 and o["sums"]["tp"] == rank


def test_shutdown_mesh_frees_every_group(ranks):
    """No gloo thread outlives shutdown_mesh() while the script still holds its mesh: one
    left to interpreter exit could abort the rank (SIGABRT) after its last line (see
    ray_mesh.core.teardown), nor while torch's module defaults bound at import hold the
    world group. A group the script itself keeps is named in a warning."""
    for rank, record in ranks.items():
        o = record["shutdown"]
        assert o["before"].count("pt_gloo_runloop") >= 6, o  # world, dp_shard, dp_replicate
        assert o["dropped"] == [], o
        if rank < 2:
            assert o["after"] == [] and o["warnings"] == [], o
            continue
        assert "pt_gloo_runloop" in o["after"], o
        assert len(o["warnings"]) == 1 and "dp_replicate are still referenced" in \
            o["warnings"][0] and "dp_shard" not in o["warnings"][0], o


def test_get_mesh_before_init_says_what_to_do():
    assert not ray_mesh.is_initialized()
    with pytest.raises(BootstrapError, match="MeshConfig.*init_mesh"):
        ray_mesh.get_mesh()


def test_init_mesh_outside_torchrun_says_what_to_do(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(BootstrapError, match="WORLD_SIZE is not set.*torchrun"):
        ray_mesh.init_mesh()


def test_init_mesh_refuses_tp_across_nodes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(BootstrapError,
                       match=r"tp\*cp = 4\*1 = 4 does not divide the 2 ranks per node"):
        ray_mesh.init_mesh({"tp": 4, "dp_shard": 1})


def test_init_mesh_again_after_shutdown_mesh(ranks):
    # torchrun's agent store outlives the world group: before each joining got keys of its
    # own, the second init_process_group read the first one's gloo addresses and failed to
    # connect ("Connection refused" after gloo's retries).
    for record in ranks.values():  # dp_shard 4, 2, 1: its group sums that, the world 4 times it
        assert record["reinit"] == [16.0, 8.0, 4.0]
