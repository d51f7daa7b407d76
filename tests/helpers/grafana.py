"""The series the deploy/monitoring Grafana dashboard plots, read from its JSON (shared by the
unit test of the dashboard file and the live-series test against a running job)."""

from __future__ import annotations

import json
import re
from pathlib import Path

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"


def dashboard_metric_names() -> set[str]:
    """Every ray_* series name the Grafana dashboard's queries and variables use."""
    dash = json.loads((MONITORING / "grafana_ray_mesh.json").read_text())
    text = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    text += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return {n for t in text for n in re.findall(r"\bray_[a-zA-Z0-9_]+", t)}
