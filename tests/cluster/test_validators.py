"""The deployment files through real tools, no engine needed (issue 14, item 5), and what the
README promises of them: docker-compose.yml against the Compose specification's JSON schema
(check-jsonschema's vendored copy), the Dockerfile through hadolint, every ${VAR} of the compose
file documented in .env, secrets never in the image."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed (pip install -e '.[test]')"
    return path


@pytest.mark.timeout(60)
def test_compose_file_matches_the_compose_specification() -> None:
    r = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(ROOT / "docker-compose.yml")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(60)
def test_compose_schema_check_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  shard0:\n    image: tessera\n    restart: sometimes\n    depends_on: {x: {condition: maybe}}\n")
    r = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad)],
                       check=False, capture_output=True, text=True)
    assert r.returncode != 0  # the validator does validate


@pytest.mark.timeout(60)
def test_dockerfile_passes_hadolint() -> None:
    r = subprocess.run([_tool("hadolint"), str(ROOT / "Dockerfile")], check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_runs_tessera_as_non_root_with_a_grpc_health_check() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^USER 10001", text, re.MULTILINE)
    assert 'ENTRYPOINT ["tessera"]' in text
    assert "HEALTHCHECK" in text and "tessera.health" in text
    assert "ARG TORCH_INDEX" in text  # the CUDA build: --build-arg TORCH_INDEX=...cu126
    assert text.count("FROM ") >= 2  # multi-stage
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"secrets", ".env", ".git", "tests"} <= set(ignored)


def test_every_compose_variable_is_documented_in_dotenv() -> None:
    used = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", (ROOT / "docker-compose.yml").read_text()))
    documented = {line.split("=", 1)[0] for line in (ROOT / ".env").read_text().splitlines()
                  if line and not line.startswith("#") and "=" in line}
    assert used - documented == set(), f"not in .env: {sorted(used - documented)}"
    assert documented - used == set(), f"in .env but unused: {sorted(documented - used)}"
    lines = (ROOT / ".env").read_text().splitlines()
    for i, line in enumerate(lines):  # each variable has a comment above it (or its group's)
        if "=" in line and not line.startswith("#"):
            assert any(lines[j].startswith("#") for j in range(max(0, i - 3), i)), f".env: {line} undocumented"


def test_compose_topology() -> None:
    model = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svc = model["services"]
    for s in ("shard0", "shard1"):
        assert f"{s}-backup" in svc and "--backup-of" in svc[f"{s}-backup"]["command"]
        assert svc[s]["healthcheck"]["test"][:4] == ["CMD", "python", "-m", "tessera.health"]
        assert svc[s]["restart"] == "on-failure" and svc[s]["volumes"]
        assert svc[f"{s}-backup"]["depends_on"][s]["condition"] == "service_healthy"
    for w in ("worker0", "worker1"):
        devices = svc[w]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        assert all(c["condition"] == "service_healthy" for c in svc[w]["depends_on"].values())
    assert svc["report"]["depends_on"]["worker0"]["condition"] == "service_completed_successfully"
    assert {n for n, s in svc.items() if "peer" in s.get("profiles", [])} == {"peer0", "peer1"}
    assert {n for n, s in svc.items() if "federated" in s.get("profiles", [])} == {"fed-server", *(f"fed-client{i}" for i in range(3))}
    assert all(s["file"].startswith("${SECRETS_DIR") for s in model["secrets"].values())


def test_grafana_dashboard_uses_only_documented_metrics() -> None:
    import json

    from tessera.metrics import FED_METRICS, RPC_METRICS, SHARD_METRICS, TRAINER_METRICS

    documented = set(RPC_METRICS + SHARD_METRICS + TRAINER_METRICS + FED_METRICS)
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {n.removesuffix("_bucket") for e in exprs for n in re.findall(r"tessera_[a-z_]+", e)}
    assert used and used <= documented, sorted(used - documented)


@pytest.mark.timeout(60)
def test_kubernetes_manifests_match_the_kubernetes_schemas() -> None:
    r = subprocess.run([_tool("kubernetes-validate"), "--strict", str(ROOT / "deploy" / "k8s" / "tessera.yaml")],
                       check=False, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "tessera.yaml").read_text())]
    assert kinds.count("StatefulSet") == 2 and "Job" in kinds and kinds.count("Service") == 2
