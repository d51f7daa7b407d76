"""Size-1 mesh dims get torch's "fake" process group: still answer by name, compute right.

Under torchrun (4 ranks, gloo, no Ray): every collective on a size-1 dim must act as on a
one-rank group (identity or copy), FSDP2 HSDP on ``mesh["dp_replicate", "dp_shard"]`` with
dp_replicate=1 and tensor parallel with tp=1 must train exactly as with real groups, and
the mesh must hold fewer real communicators than one with a real group per dim.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from torchrun import torchrun

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.distributed_c10d import _world
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module)
    import ray_mesh
    from ray_mesh.core.bootstrap import build_device_mesh
    from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS

    def real_groups():
        return sum(1 for b, _ in _world.pg_map.values() if str(b) != "fake")

    mesh = ray_mesh.init_mesh({"dp_replicate": 1, "dp_shard": -1})
    spec, rank = ray_mesh.get_state().spec, dist.get_rank()
    after_fake = real_groups()
    ref = build_device_mesh(spec, "cpu", real_size1_groups=True)
    after_real = real_groups()
    out = {"rank": rank, "backends": {}, "ranks": {}, "local": {}, "coll": {},
           "real_groups_fake_mesh": after_fake - 1,  # minus the default group
           "real_groups_real_mesh": after_real - after_fake}
    for d in (*DIM_NAMES, *FLATTENED_DIMS):
        g = mesh.get_group(d)
        out["backends"][d] = str(dist.get_backend(g))
        out["ranks"][d] = dist.get_process_group_ranks(g)
        out["local"][d] = [mesh[d].size(), mesh[d].get_local_rank()]
    for d in ("pp", "cp", "tp", "dp_replicate"):
        g, r = mesh.get_group(d), float(rank + 1)
        c = {}
        for op in ("SUM", "AVG", "MAX", "PRODUCT"):
            t = torch.tensor([r, 2.0]); dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=g)
            c["all_reduce_" + op] = t.tolist()
        o = [torch.full((2,), -7.0)]; dist.all_gather(o, torch.tensor([r, 3.0]), group=g)
        c["all_gather"] = o[0].tolist()
        o = torch.full((2,), -7.0); dist.all_gather_into_tensor(o, torch.tensor([r, 3.0]), group=g)
        c["all_gather_into_tensor"] = o.tolist()
        o = torch.full((2,), -7.0); dist.reduce_scatter_tensor(o, torch.tensor([r, 4.0]), group=g)
        c["reduce_scatter_tensor"] = o.tolist()
        o = torch.full((2,), -7.0); dist.reduce_scatter(o, [torch.tensor([r, 5.0])], group=g)
        c["reduce_scatter"] = o.tolist()
        t = torch.tensor([r]); dist.broadcast(t, src=rank, group=g); c["broadcast"] = t.tolist()
        t = torch.tensor([r]); dist.reduce(t, dst=rank, group=g); c["reduce"] = t.tolist()
        o = torch.full((2,), -7.0); dist.all_to_all_single(o, torch.tensor([r, 6.0]), group=g)
        c["all_to_all_single"] = o.tolist()
        objs = [None]; dist.all_gather_object(objs, {"r": rank}, group=g)
        c["all_gather_object"] = objs
        objs = [{"r": rank}]; dist.broadcast_object_list(objs, src=rank, group=g)
        c["broadcast_object_list"] = objs
        dist.barrier(group=g)
        out["coll"][d] = c

    def train(sub, tp_mesh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=sub)
        fully_shard(model, mesh=sub)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses = []
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(6, 8, generator=g)
            loss = model(x).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        params = [p.full_tensor().flatten().tolist() for p in model.parameters()]
        return losses, params

    # FSDP2 HSDP (dp_replicate=1 is the fake dim) composed with TP on the fake tp dim.
    hsdp_dims = ("dp_replicate", "dp_shard")
    out["fake_train"] = train(mesh[hsdp_dims], mesh["tp"])
    out["real_train"] = train(ref[hsdp_dims], ref["tp"])
    with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
        json.dump(out, f)
    ray_mesh.shutdown_mesh()
""")


def _phases(texts: list[str]) -> str:
    """One script that runs each of ``texts`` in turn in the same 4 ranks (a fresh namespace
    each, ``sys.argv[1]`` its own output folder): each launch of 4 ranks costs ~6 s of the
    suite's 2 cores. Each text ends with shutdown_mesh(), which frees every group."""
    return textwrap.dedent(f"""
        import os, sys
        out = sys.argv[1]
        for i, text in enumerate({texts!r}):
            os.makedirs(os.path.join(out, str(i)), exist_ok=True)
            sys.argv[1:] = [os.path.join(out, str(i))]
            exec(compile(text, f"<phase {{i}}>", "exec"), {{"__name__": "__main__"}})
    """)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[list[dict]]:
    """Per script (:data:`SCRIPT`, :data:`TWIN_SCRIPT`), each rank's JSON record, from one
    torchrun with ray_mesh's defaults."""
    tmp = tmp_path_factory.mktemp("size1")
    script = tmp / "script.py"
    script.write_text(_phases([SCRIPT, TWIN_SCRIPT]))
    proc = torchrun(script, str(tmp), timeout=300, env={"RAY_MESH_REAL_SIZE1_GROUPS": None})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [[json.loads((tmp / str(i) / f"{rank}.json").read_text()) for rank in range(4)]
            for i in range(2)]


def test_size1_dims_are_fake_groups_with_one_rank_semantics(ranks):
    for rank, o in enumerate(ranks[0]):
        size1 = ("pp", "dp_replicate", "cp", "tp")
        for d in size1:
            assert o["backends"][d] == "fake", (d, o["backends"])
            assert o["ranks"][d] == [rank]
            assert o["local"][d] == [1, 0]
        for d in ("dp_shard", "dp", "dp_shard_cp", "dp_cp"):
            assert o["backends"][d] == "gloo", (d, o["backends"])
            assert o["ranks"][d] == [0, 1, 2, 3]
            assert o["local"][d] == [4, rank]
        r = float(rank + 1)
        for d in size1:
            c = o["coll"][d]
            for op in ("SUM", "AVG", "MAX", "PRODUCT"):
                assert c["all_reduce_" + op] == [r, 2.0], (d, op, c)
            assert c["all_gather"] == c["all_gather_into_tensor"] == [r, 3.0], (d, c)
            assert c["reduce_scatter_tensor"] == [r, 4.0], (d, c)
            assert c["reduce_scatter"] == [r, 5.0], (d, c)
            assert c["broadcast"] == c["reduce"] == [r], (d, c)
            assert c["all_to_all_single"] == [r, 6.0], (d, c)
            assert c["all_gather_object"] == c["broadcast_object_list"] == [{"r": rank}]
        # dp_shard and every flattened dim span the world (torch reuses the default
        # group), so no real group beyond it; a real group per dim adds pp, dp_replicate,
        # cp and tp.
        assert o["real_groups_fake_mesh"] == 0, o["real_groups_fake_mesh"]
        assert o["real_groups_real_mesh"] == 4, o["real_groups_real_mesh"]
        fake_losses, fake_params = o["fake_train"]
        real_losses, real_params = o["real_train"]
        assert fake_losses == real_losses
        assert fake_params == real_params
        assert fake_losses[-1] < fake_losses[0]


TWIN_SCRIPT = textwrap.dedent("""
    import json, os, sys, warnings
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.distributed_c10d import _world
    from torch.distributed.fsdp import fully_shard
    import ray_mesh
    from ray_mesh.core.bootstrap import build_device_mesh, twin_dims
    from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS
    warnings.simplefilter("ignore")  # torch: slicing a flattened dim from the root mesh

    def real_groups():
        return sum(1 for b, _ in _world.pg_map.values() if str(b) != "fake")

    mesh = ray_mesh.init_mesh({"pp": 2, "dp_shard": -1})
    spec, rank = ray_mesh.get_state().spec, dist.get_rank()
    shared = real_groups() - 1  # minus the default group
    before = real_groups()
    ref = build_device_mesh(spec, "cpu", real_size1_groups=True)
    out = {"twins": twin_dims(spec), "real_groups": shared,
           "real_groups_all_real": real_groups() - before, "groups": {}}
    for d in (*DIM_NAMES, *FLATTENED_DIMS):
        g = mesh.get_group(d)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        out["groups"][d] = {"name": g.group_name, "backend": str(dist.get_backend(g)),
                            "ranks": dist.get_process_group_ranks(g), "sum": t.item(),
                            "local": [mesh[d].size(), mesh[d].get_local_rank()]}

    def train(sub):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        fully_shard(model, mesh=sub)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        losses = []
        for step in range(4):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step + 10 * rank))
            loss = model(x).square().mean()
            loss.backward(); opt.step(); opt.zero_grad()
            losses.append(loss.item())
        return losses, [p.full_tensor().flatten().tolist() for p in model.parameters()]

    out["shared_train"] = train(mesh["dp_shard_cp"])
    out["real_train"] = train(ref["dp_shard_cp"])
    with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
        json.dump(out, f)
    ray_mesh.shutdown_mesh()
""")


def test_flattened_dims_that_repeat_a_dim_share_its_group(ranks):
    """pp=2 x dp_shard=2, cp=1: dp, dp_shard_cp and dp_cp are dp_shard's groups, not copies."""
    for rank, o in enumerate(ranks[1]):
        assert o["twins"] == {"dp": "dp_shard", "dp_shard_cp": "dp_shard", "dp_cp": "dp_shard"}
        g = o["groups"]
        pair = [0, 1] if rank < 2 else [2, 3]
        for d in ("dp_shard", "dp", "dp_shard_cp", "dp_cp"):
            assert g[d]["name"] == g["dp_shard"]["name"], (d, g)
            assert g[d]["backend"] == "gloo" and g[d]["ranks"] == pair, (d, g[d])
            assert g[d]["sum"] == sum(r + 1 for r in pair)
            assert g[d]["local"] == [2, rank % 2]
        assert g["pp"]["ranks"] == [rank % 2, rank % 2 + 2]
        # pp and dp_shard only; one real group per dim would hold 8 (3 of them copies of
        # dp_shard's, 3 for size-1 dims).
        assert o["real_groups"] == 2, o["real_groups"]
        assert o["real_groups_all_real"] == 8, o["real_groups_all_real"]
        assert o["shared_train"] == o["real_train"]
        assert o["shared_train"][0][-1] < o["shared_train"][0][0]


def test_twin_dims_pairs_flattened_dims_with_the_dim_they_repeat():
    from ray_mesh.core.bootstrap import twin_dims
    from ray_mesh.core.spec import MeshSpec

    # HSDP 2 x 2: dp and dp_cp span the world (torch reuses the default group).
    assert twin_dims(MeshSpec(dp_replicate=2, dp_shard=2)) == {"dp_shard_cp": "dp_shard"}
    assert twin_dims(MeshSpec(pp=2, dp_replicate=2, dp_shard=2)) == {
        "dp_shard_cp": "dp_shard", "dp_cp": "dp"}
    # cp > 1 with dp_replicate > 1: every flattened dim has groups of its own.
    assert twin_dims(MeshSpec(dp_replicate=2, dp_shard=2, cp=2)) == {}
    assert twin_dims(MeshSpec(pp=2, dp_shard=2, cp=2)) == {"dp": "dp_shard",
                                                           "dp_cp": "dp_shard_cp"}
    # Size-1 flattened dims are fake groups, not twins.
    assert twin_dims(MeshSpec(pp=2, dp_shard=1, tp=2)) == {}
