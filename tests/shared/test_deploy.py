"""What can be checked of the deployment files without a Docker engine: the compose file
against the compose specification (the compose-spec library: a Rust parser that rejects
what Compose would), every service command a real CLI command, every BATCHWRIGHT_ variable
a real setting, the example registry valid, the dashboard built on metrics that exist, and
the build context free of the virtualenv."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from batchwright.cli import app
from batchwright.config import Settings
from batchwright.registry import load_registry

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
# Variables read by something other than batchwright (the images, CUDA).
OTHER_ENV = {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB", "CUDA_VISIBLE_DEVICES"}


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_file_is_valid_compose() -> None:
    from compose_spec import PyCompose
    from compose_spec.models import ComposeSpecification

    # The parser does not resolve YAML merge keys (`<<: *app`), which Compose does at the
    # YAML level: it gets the document as Compose sees it after loading.
    parsed = PyCompose.from_yaml(yaml.safe_dump(compose()))  # raises outside the spec
    names = set(parsed.service_names())
    assert {"postgres", "redis", "migrate", "api", "control", "beat", "worker-cpu"} <= names
    ComposeSpecification.model_validate(compose())


def test_one_image_built_once_and_a_gpu_profile() -> None:
    services = compose()["services"]
    built = [name for name, svc in services.items() if "build" in svc]
    assert built == ["migrate"]
    ours = [s for s in services.values() if s.get("image") == "batchwright:local"]
    assert len(ours) >= 6
    assert all(s.get("pull_policy") == "never" for s in ours if "build" not in s)
    # Plain `docker compose up` needs no GPU: only profiled services reserve one.
    for name, svc in services.items():
        reserves_gpu = "devices" in str(svc.get("deploy", {}))
        assert not reserves_gpu or svc.get("profiles") == ["gpu"], name
    assert "gpu" in services["worker-gpu"]["profiles"]
    assert "profiles" not in services["worker-cpu"]


def _commands() -> list[tuple[str, list[str]]]:
    return [
        (name, svc["command"])
        for name, svc in compose()["services"].items()
        if svc.get("command") and svc["command"][0] == "batchwright"
    ]


@pytest.mark.parametrize("name", [n for n, _ in _commands()])
def test_service_command_is_a_real_cli_command(name: str) -> None:
    command = dict(_commands())[name]
    # --help after the real arguments: click parses them (unknown options fail) and stops.
    out = CliRunner().invoke(app, [*command[1:], "--help"])
    assert out.exit_code == 0, out.output


def test_every_batchwright_variable_is_a_setting() -> None:
    fields = {f"BATCHWRIGHT_{name.upper()}" for name in Settings.model_fields}
    found: set[str] = set()
    for svc in compose()["services"].values():
        env = svc.get("environment") or {}
        found |= set(env if isinstance(env, dict) else [e.split("=")[0] for e in env])
    found |= set(re.findall(r"\$\{(BATCHWRIGHT_\w+?)(?::-[^}]*)?\}", COMPOSE.read_text()))
    ours = {v for v in found if v.startswith("BATCHWRIGHT_")}
    # BATCHWRIGHT_GPU_MODELS is read by compose itself (interpolation), not by the code.
    assert ours - {"BATCHWRIGHT_GPU_MODELS"} <= fields, ours - fields
    assert found - ours <= OTHER_ENV, found - ours


def test_example_registry_parses_with_quoted_names(tmp_path: Path) -> None:
    example = ROOT / "workers" / "models.example.toml"
    raw = tomllib.loads(example.read_text())
    assert set(raw["models"]) == {"qwen2.5-0.5b", "llama-3.1-8b"}
    # models="": the suite exports an inline registry for its own services.
    registry = load_registry(Settings(models_file=example, models="", home=tmp_path))
    assert registry.names == ["demo", "llama-3.1-8b", "qwen2.5-0.5b"]


def test_dashboard_uses_only_metrics_that_exist() -> None:
    from prometheus_client import REGISTRY

    import batchwright.api.metrics as api_metrics
    import batchwright.worker.metrics  # noqa: F401  (registers the worker's metrics)

    # Every sample name a registered metric can produce (_total, _bucket, ...); a metric
    # with labels has no samples before its first use, so ask the registry's index.
    known = set(REGISTRY._names_to_collectors)
    known |= {"batchwright_batches", "batchwright_lines", "batchwright_workers_live"}
    known |= {"batchwright_oldest_queued_line_age_seconds"}
    assert api_metrics.QueueCollector  # the four gauges above come from it at scrape time
    dashboard = (ROOT / "deploy" / "grafana" / "dashboards" / "batchwright.json").read_text()
    used = set(re.findall(r"batchwright_[a-z_]+", dashboard))
    used.discard("batchwright_")
    for name in used:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in known or base in known, name


def test_build_context_leaves_out_the_virtualenv() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    dockerfile = (ROOT / "Dockerfile").read_text()
    # The base's torch is at least the worker extra's floor, and that floor has the
    # varlen_attn the CUDA path calls (seqused_k, block_table: torch 2.12).
    match = re.search(r"FROM pytorch/pytorch:(\d+)\.(\d+)", dockerfile)
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert match and floor
    base, extra = (int(match[1]), int(match[2])), (int(floor[1]), int(floor[2]))
    assert base >= extra >= (2, 12)
