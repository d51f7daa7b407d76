"""`ray-mesh status --html`: the page's content, and what headless Chromium draws of it.

The Chromium test needs the distribution's ``chromium`` and the ``playwright`` wheel (the
test extra; .ci/run installs chromium). It skips without them, except under CI=true, where
a missing browser is a failure. With RAY_MESH_UPDATE_SCREENSHOTS=1 it also refreshes
docs/mesh_status.png, the README's picture.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ray_mesh.status.cluster import ClusterStatus
from ray_mesh.status.html import (
    merge_history,
    previous_data,
    render,
    step_colour,
    write_html,
)

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
IPS = ("100.64.0.1", "100.64.0.2")


def _status(step: int = 40, loss: float = 0.9, slow_rank: int = 3,
            rate: float = 160.0) -> ClusterStatus:
    nodes = [{"node_id": f"n{i}", "ip": ip, "state": "ALIVE", "head": i == 0, "CPU": 2,
              "GPU": 0} for i, ip in enumerate(IPS)]
    ranks = []
    for r in range(4):
        ranks.append({"rank": r, "node": r // 2, "node_ip": IPS[r // 2], "interface": "tailscale0",
                      "device": "cpu", "pp": 0, "dp_replicate": r // 2, "dp_shard": 0, "cp": 0,
                      "tp": r % 2, "step": step, "step_s": 0.25 if r == slow_rank else 0.1,
                      "samples/s": rate + r, "loss": loss + 0.01 * r})
    run = {"name": "hsdp", "id": "abc", "status": "RUNNING", "started": "10:00:00 UTC",
           "mesh": "MeshSpec(dp_replicate=2, tp=2)", "layout_source": "run dir",
           "ranks": ranks}
    return ClusterStatus(dashboard="http://100.64.0.1:8265", nodes=nodes, runs=[run])


LINKS = [{"a": IPS[0], "b": IPS[1], "mbit_s": 940.0}]


def _history(points: int = 12) -> dict:
    history: dict = {}
    for i in range(points):
        history = merge_history(history, _status(step=10 * (i + 1), loss=2.0 / (1 + i),
                                                 rate=150 + 30 * (1 - 0.8 ** i)), now=1000.0 + i)
    return history


def test_history_grows_across_renders_and_replaces_a_repeated_step(tmp_path):
    page = tmp_path / "mesh.html"
    write_html(page, _status(step=10, loss=1.0), links=LINKS)
    write_html(page, _status(step=20, loss=0.8))
    write_html(page, _status(step=20, loss=0.7))  # same step again: replaces
    data = previous_data(page)
    points = data["history"]["hsdp"]
    assert [p["step"] for p in points] == [10, 20]
    assert points[-1]["loss"] == pytest.approx(0.7 + 0.015)  # mean over the 4 ranks
    assert data["links"] == LINKS  # kept from the first render


def test_page_is_self_contained_and_escapes_names():
    status = _status()
    status.runs[0]["name"] = "<script>x</script>"
    text = render(status, links=LINKS)
    assert "<script>x</script>" not in text
    assert "http://" not in text.replace("http://100.64.0.1:8265", "").replace(
        "http://www.w3.org/2000/svg", "")
    assert "<script src" not in text and "<link" not in text


def test_step_colour_against_the_median():
    assert step_colour(0.1, 0.1) == step_colour(0.109, 0.1) != step_colour(0.13, 0.1)
    assert step_colour(0.2, 0.1) != step_colour(0.13, 0.1)
    assert step_colour(None, 0.1) == step_colour(0.1, None)


def _browser():
    """Playwright's Chromium on the system binary, or a skip (a failure under CI=true)."""
    missing = []
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing.append("chromium (apt-get install -y chromium chromium-driver)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install -e '.[test]')")
    if missing:
        why = "needs " + " and ".join(missing)
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true but this test {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    return sync_playwright


def test_chromium_draws_nodes_ranks_links_and_curves(tmp_path):
    sync_playwright = _browser()
    page_file = tmp_path / "mesh.html"
    page_file.write_text(render(_status(step=120, loss=2.0 / 12), links=LINKS,
                                history=_history()), encoding="utf-8")
    requests: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=shutil.which("chromium") or CHROMIUM,
                                     args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 920, "height": 560})
            page.on("request", lambda req: requests.append(req.url))
            page.goto(page_file.as_uri(), wait_until="load", timeout=30_000)
            assert page.locator("svg.mesh g.node").count() == 2
            assert page.locator("svg.mesh g.rank").count() == 4
            assert page.locator("g.node[data-node='100.64.0.2'] g.rank").count() == 2
            assert page.locator("text.link-label").first.text_content() == "940 Mbit/s"
            curves = page.locator("path.curve")
            assert curves.count() == 2
            d = page.locator("path.curve[data-key='loss']").get_attribute("d")
            assert d.count("L") == 11  # 12 points
            # Laid out for real: the rank cells have a size on screen, inside their node.
            node = page.locator("g.node").nth(1).bounding_box()
            cell = page.locator("g.rank[data-rank='3'] rect").bounding_box()
            assert cell["width"] > 100 and node["x"] <= cell["x"] <= node["x"] + node["width"]
            text = page.locator("body").inner_text()
            assert "250 ms/step" in text and "rep1 tp1" in text
            assert "slowest rank 3: 250 ms (2.50x)" in text
            out = tmp_path / "mesh_status.png"
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    assert all(u.startswith("file://") for u in requests), requests  # nothing fetched
    assert out.stat().st_size > 10_000
    if os.environ.get("RAY_MESH_UPDATE_SCREENSHOTS") == "1":  # the README's picture
        shutil.copyfile(out, REPO / "docs" / "mesh_status.png")


def test_cli_status_takes_html():
    from ray_mesh.cli.main import build_parser

    args = build_parser().parse_args(["status", "--html", "mesh.html"])
    assert args.html == "mesh.html"
