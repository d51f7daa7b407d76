"""A job with ``replica_groups:`` and ``data:``: the data section is checked on the driver as
for one mesh (one group's step as its batch), before Ray starts; the sections that still do
not go with replica groups are refused by name; the groups' config carries the data and
how to read it by index; the end summary shows tokens/s. Ray-free except the summary's
module (which imports Ray, as the CLI does)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ray_mesh.cli.job import Job, JobError
from ray_mesh.data.indexed import INDEX_KEY, manifest

ROOT = Path(__file__).resolve().parents[2]
GROUPS = {"groups": [{"dp_shard": 2}, {"dp_shard": 1}], "steps": 5, "segment_samples": 4}


def _job(data=None, groups=None, **top) -> dict:
    return {"train": "llm.py:train_groups", "replica_groups": {**GROUPS, **(groups or {})},
            "config": {"model": {"max_seq_len": 64}},
            "data": {"paths": ["stdlib"], "seq_len": 32, **(data or {})}, **top}


def test_data_goes_with_replica_groups_with_one_groups_step_as_its_batch():
    job = Job.from_dict(_job(), base_dir=ROOT / "examples")
    assert job.data.global_batch == 4 and job.data.seq_len == 32
    assert job.replica_groups.data_from == "files"
    assert "data_from" not in job.replica_groups.fit_kwargs()  # the CLI's, not the fit's
    assert job.replica_groups.fit_kwargs()["compress"] == "none"  # float32 unless asked
    packed = Job.from_dict(_job(groups={"compress": "int8"}), base_dir=ROOT / "examples")
    assert packed.replica_groups.fit_kwargs()["compress"] == "int8"
    example = Job.from_yaml(ROOT / "examples" / "llm_groups.yaml")
    assert example.data.global_batch == example.replica_groups.segment_samples == 8
    assert example.load_train_fn().__name__ == "train_groups"


@pytest.mark.parametrize(("data", "groups", "top", "why"), [
    ({"paths": ["no/such/*.txt"]}, {}, {}, r"data.paths\[0\] = 'no/such/\*.txt' matches no "
                                           r"file"),
    ({"seq_len": 128}, {}, {}, r"seq_len=128 is longer than the model's max_seq_len=64"),
    ({"batch_size": 8}, {}, {}, r"data.batch_size does not go with replica_groups: a group's "
                                r"batch is replica_groups.segment_samples"),
    ({"batch_tokens": 128}, {}, {}, r"data.batch_tokens does not go with replica_groups"),
    ({}, {"segment_samples": 5}, {}, r"segment_samples=5 does not split over group 0's 2 "
                                     r"data-parallel ranks.*multiple of 2, e.g. 4"),
    ({"max_tokens": 100}, {}, {}, r"max_tokens=100 holds no group's step of 4 rows of 33"),
    ({"validation": 0.999}, {"segment_samples": 4000}, {},
     r"training split is empty or too small.*one group's step needs"),
    ({}, {"data_from": "ray"}, {}, r"replica_groups.data_from must be one of files, ray_data"),
    ({}, {"compress": "fp8"}, {}, r"replica_groups.compress must be one of none, bf16, int8"),
    ({"paths": 7}, {}, {}, r"data.paths must be a path"),
    # still refused with replica_groups, by name
    ({}, {}, {"mesh": {"dp_shard": 2}}, r"^mesh: does not go with replica_groups"),
    ({}, {}, {"layout": "fsdp"}, r"^layout: does not go with replica_groups"),
    ({}, {}, {"replicate": {"mode": "diloco"}}, r"^replicate: does not go with replica_groups"
                                                 r".*replica_group\(\.\.\., diloco=\.\.\.\)"),
    ({}, {}, {"plan": {"model": "x.py:f"}}, r"^plan: does not go with replica_groups"),
    ({}, {}, {"scaling": {"num_workers": 3}}, r"^scaling.num_workers does not go with"),
    ({}, {}, {"run": {"min_workers": 1}}, r"^run.min_workers does not go with"),
])
def test_a_bad_data_section_of_replica_groups_is_refused_with_the_fix(data, groups, top, why):
    with pytest.raises(JobError, match=why):
        Job.from_dict(_job(data, groups, **top))


def test_a_bad_data_section_of_replica_groups_fails_on_the_driver_before_ray(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text(f"train: {ROOT / 'examples' / 'llm.py'}:train_groups\n"
                   "replica_groups: {groups: [{dp_shard: 1}], steps: 3, segment_samples: 4}\n"
                   "data: {paths: [missing_dir/**/*.txt], seq_len: 32}\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""}
    proc = subprocess.run([sys.executable, "-m", "ray_mesh.cli.main", "run", str(job)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "ray-mesh: error: data.paths[0] = 'missing_dir/**/*.txt' matches no file" \
        in proc.stderr, proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert not (tmp_path / "ray_results").exists()


def test_the_groups_config_carries_the_data_and_the_drivers_manifest():
    from ray_mesh.cli.groups_runner import group_config

    job = Job.from_dict(_job(config={"lr": 0.1}))
    config = group_config(job)
    assert config["lr"] == 0.1 and config["data"] == job.data.to_dict()
    assert config[INDEX_KEY] == {"manifest": manifest(job.data)}
    plain = Job.from_dict({"train": "x.py:f", "config": {"lr": 0.1},
                           "replica_groups": GROUPS})
    assert group_config(plain) == {"lr": 0.1}


def test_the_summary_shows_each_groups_tokens_per_s_and_their_sum():
    from ray_mesh.cli.groups_runner import GroupsOutcome, groups_summary

    result = SimpleNamespace(
        groups={0: {"metrics": {"step": 5, "loss": 2.5, "samples": 40, "tokens": 1280,
                                "steps_per_s": 1.0, "samples_per_s": 8.0,
                                "tokens_per_s": 256.0, "replica_groups/live": 2}},
                1: {"metrics": {"step": 5, "loss": 2.6}}},  # reported no counts: its pace
        status={"step": 5, "layouts": {0: "dp_shard=2", 1: "dp_shard=1"}, "consumed": 72,
                "shares": {0: {"samples_per_s": 9.0}, 1: {"samples_per_s": 4.0}}},
        events=[])
    lines, ok = groups_summary("llm_groups", None, GroupsOutcome(result, 12.0, 32))
    text = "\n".join(lines)
    assert ok and "  group 0 (dp_shard=2): 8 samples/s, 256 tokens/s, step=5, loss=2.5" in text
    # no counts reported: its pace for shares, said as such, and not summed as throughput
    assert "  group 1 (dp_shard=1): pace 4 samples/s, 128 tokens/s, step=5, loss=2.6" in text
    assert "  throughput:  8 samples/s, 256 tokens/s (the reporting groups' rates summed, " \
           "each from its first report to its last); 72 samples used" in text
    assert "tokens_per_s=" not in text and "replica_groups/" not in text
    # one report after a late rejoin: its window's tokens/s by its loop's clock, and the
    # samples/s of the same window (not the quorum's pace beside it: 4 samples/s against
    # 320 tokens/s of 32-token samples cannot both be true), not summed as the run's
    result.groups[1] = {"metrics": {"step": 5, "loss": 2.6, "tokens_per_s": 320.0}}
    lines, ok = groups_summary("llm_groups", None, GroupsOutcome(result, 12.0, 32))
    text = "\n".join(lines)
    assert ok and "  group 1 (dp_shard=1): 10 samples/s, 320 tokens/s, in its last report's " \
        "window only (one report: not in the throughput below), step=5, loss=2.6" in text, text
    assert "  throughput:  8 samples/s, 256 tokens/s (" in text, text
    # no group reported counts (examples/replica_groups.py): what the run did, start-up in
    result.groups = {0: {"metrics": {"step": 5}}, 1: {"metrics": {"step": 5}}}
    lines, ok = groups_summary("rg", None, GroupsOutcome(result, 12.0, None))
    text = "\n".join(lines)
    assert "  group 1 (dp_shard=1): pace 4 samples/s, step=5" in text, text
    assert "  throughput:  72 samples used in 12.0 s, 6 samples/s (start-up included" in text
    # a group whose box had not come back at the end: said, and the run still succeeded;
    # a group that ended with an error fails it
    result.groups[1] = {"metrics": None, "error": None,
                        "absent": "its node did not come back before the run finished"}
    lines, ok = groups_summary("rg", None, GroupsOutcome(result, 12.0, None))
    text = "\n".join(lines)
    assert ok and "  group 1 (dp_shard=1): pace 4 samples/s, not there at the end: its node " \
        "did not come back before the run finished; the other groups took its samples" in text
    result.groups[1] = {"metrics": None, "error": "RuntimeError: boom"}
    lines, ok = groups_summary("rg", None, GroupsOutcome(result, 12.0, None))
    assert not ok and "ended with RuntimeError: boom" in "\n".join(lines)


def test_compress_is_one_of_the_modes_and_not_beside_diloco():
    """``compress`` between replica groups: refused on the driver when it is no mode, and in
    the group when the train function also gives DiLoCo (whose config has its own)."""
    from ray_mesh.core.diloco_config import check_group_compress
    from ray_mesh.errors import ParallelError

    for mode in ("none", "bf16", "int8"):
        check_group_compress(mode, False)
    check_group_compress("none", True)
    with pytest.raises(ParallelError, match=r"compress='fp8': use one of none, bf16, int8"):
        check_group_compress("fp8", False)
    with pytest.raises(ParallelError, match=r"with DiLoCo.*DiLoCoConfig\(compress='int8'\)"):
        check_group_compress("int8", True)


def test_diloco_streaming_and_overlap_are_refused_for_groups():
    """A group's outer step is one whole sync at its commit: ``streaming`` and ``overlap``
    (one mesh's ``DiLoCo.step()`` settings) would be ignored, so they are refused by name."""
    from ray_mesh.core.diloco_config import DiLoCoConfig, check_group_diloco
    from ray_mesh.errors import ParallelError

    check_group_diloco(DiLoCoConfig(every=4, compress="int8"))
    with pytest.raises(ParallelError, match=r"DiLoCoConfig\(overlap=2\) with replica groups.*"
                                            r"Leave overlap out"):
        check_group_diloco(DiLoCoConfig(every=4, overlap=2))
    with pytest.raises(ParallelError, match=r"DiLoCoConfig\(streaming=2\) with replica groups"):
        check_group_diloco(DiLoCoConfig(every=4, streaming=2))
