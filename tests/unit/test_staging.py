"""Upload-mode staging: a private per-run, per-rank temp directory (issue #18 item 7).

The old fixed ``/tmp/ray_mesh_staging/<run>/rank<r>`` could be created first by another
local user; :class:`StagingDir` uses ``mkdtemp`` (0700, unpredictable) and is the only one
that removes its directory.
"""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
from pathlib import Path

from ray_mesh.checkpointing.staging import PREFIX, StagingDir


def test_private_unpredictable_and_per_rank(tmp_path):
    a, b = StagingDir("run", 0, base=str(tmp_path)), StagingDir("run", 0, base=str(tmp_path))
    assert not a.created  # nothing on disk until a save or a download needs it
    pa, pb = a.path, b.path
    assert pa != pb  # two runs (or attempts) with the same name never share a directory
    for p in (pa, pb):
        mode = stat.S_IMODE(os.lstat(p).st_mode)
        assert mode == 0o700, oct(mode)
        assert p.parent == tmp_path and p.name.startswith(f"{PREFIX}run_rank0_")
        assert os.lstat(p).st_uid == os.getuid() and not p.is_symlink()
    assert StagingDir("run", 3, base=str(tmp_path)).path.name.startswith(f"{PREFIX}run_rank3_")


def test_run_name_cannot_escape_the_temp_dir(tmp_path):
    d = StagingDir("../../etc/x y", 1, base=str(tmp_path)).path
    assert d.parent == tmp_path and "/" not in d.name and ".._.._etc_x_y" in d.name


def test_a_planted_directory_at_the_old_path_is_not_used(tmp_path):
    # Another user's symlink where the old code would have staged: ignored, left alone.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    old = tmp_path / "ray_mesh_staging" / "run"
    old.mkdir(parents=True)
    (old / "rank0").symlink_to(victim)
    s = StagingDir("run", 0, base=str(tmp_path))
    (s.path / "checkpoint_000001").mkdir()
    s.cleanup()
    assert (victim / "keep").read_text() == "x" and (old / "rank0").is_symlink()


def test_cleanup_removes_only_its_own_directory(tmp_path):
    s = StagingDir("run", 0, base=str(tmp_path))
    keeper = StagingDir("run", 0, base=str(tmp_path))
    other = keeper.path
    (s.path / "shards").mkdir()
    (s.path / "shards" / "0.distcp").write_bytes(b"\0" * 10)
    first = s.path
    s.cleanup()
    s.cleanup()  # idempotent
    assert not first.exists() and other.is_dir()
    assert not s.created
    keeper.cleanup()


def test_removed_when_garbage_collected_or_at_exit(tmp_path):
    s = StagingDir("run", 0, base=str(tmp_path))
    p = s.path
    del s
    gc.collect()
    assert not p.exists()
    # A process that exits without calling cleanup() (e.g. the train function raised).
    code = ("import sys; from ray_mesh.checkpointing.staging import StagingDir; "
            "s = StagingDir('run', 2, base=sys.argv[1]); print(s.path)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert out.stdout.strip() and not Path(out.stdout.strip()).exists()
