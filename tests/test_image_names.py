"""One image name everywhere: the chart's default, the examples, the Dockerfiles' comments, the kind path
and the e2e image build agree on pdcluster/operator:<version> and pdcluster/worker:<version>."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
OPERATOR = f"pdcluster/operator:{VERSION}"
WORKER = f"pdcluster/worker:{VERSION}"
WORKER_VLLM = f"pdcluster/worker-vllm:{VERSION}"
WORKER_DEPS = f"pdcluster/worker-deps:{VERSION}"  # worker.Dockerfile's deps stage, worker-vllm's base


def test_chart_default_is_the_operator_image():
    values = yaml.safe_load((ROOT / "helm/pdcluster-operator/values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "helm/pdcluster-operator/Chart.yaml").read_text())
    tag = values["image"]["tag"] or chart["appVersion"]
    assert f"{values['image']['repository']}:{tag}" == OPERATOR
    schema = json.loads((ROOT / "helm/pdcluster-operator/values.schema.json").read_text())
    assert "image" in schema["properties"]


def test_examples_use_the_worker_image():
    for f in ("examples/pdcluster.yaml", "examples/pdcluster-cpu.yaml"):
        assert yaml.safe_load((ROOT / f).read_text())["spec"]["image"] == WORKER, f


def test_dockerfiles_name_their_image_and_nothing_else():
    for name, image in (("operator", OPERATOR), ("worker", WORKER), ("worker-vllm", WORKER_VLLM)):
        text = (ROOT / f"docker/{name}.Dockerfile").read_text()
        assert f"docker build -f docker/{name}.Dockerfile -t {image} ." in text
        others = set(re.findall(r"pdcluster/[a-z-]+:[\w.-]+", text)) - {image} - (
            {WORKER_DEPS} if name == "worker-vllm" else set())
        assert not others, (name, others)
    assert sorted(p.name for p in (ROOT / "docker").glob("*.Dockerfile")) == [
        "operator.Dockerfile", "worker-vllm.Dockerfile", "worker.Dockerfile"]


def test_e2e_paths_build_the_same_files():
    images = (ROOT / "e2e/images.sh").read_text()
    assert 'OPERATOR_IMAGE="pdcluster/operator:$VERSION"' in images
    assert 'WORKER_IMAGE="pdcluster/worker:$VERSION"' in images
    assert 'WORKER_VLLM_IMAGE="pdcluster/worker-vllm:$VERSION"' in images
    assert 'WORKER_DEPS_IMAGE="localhost/pdcluster/worker-deps:$VERSION"' in images
    vllm = (ROOT / "docker/worker-vllm.Dockerfile").read_text()
    assert f"ARG DEPS_IMAGE={WORKER_DEPS}" in vllm and f"-t {WORKER_DEPS} ." in vllm


def test_the_operator_defaults_vllm_pools_to_the_worker_vllm_image():
    from pdcluster.operator.models import DEFAULT_VLLM_IMAGE

    assert DEFAULT_VLLM_IMAGE == WORKER_VLLM
    kind = (ROOT / "e2e/kind/run.sh").read_text()
    assert "docker/operator.Dockerfile" in kind and "docker/worker.Dockerfile" in kind
    assert not re.search(r"ghcr\.io/pdcluster", "\n".join(
        p.read_text() for p in [*ROOT.glob("examples/*.yaml"), *ROOT.glob("docker/*"), ROOT / "docs/e2e.md"]))


def test_nixl_progress_delay_has_one_default():
    """The vLLM environments' rewritten NIXL agent (docker/nixl-progress-delay.py) and our engine's agents read
    one knob, PDCLUSTER_NIXL_PROGRESS_DELAY_US, with one default."""
    from pdcluster.worker.transfer import nixl_agent

    text = (ROOT / "docker/nixl-progress-delay.py").read_text()
    assert f'DEFAULT_US = "{nixl_agent.PROGRESS_DELAY_US}"' in text
    assert "PDCLUSTER_NIXL_PROGRESS_DELAY_US" in text and "PDCLUSTER_NIXL_PROGRESS_DELAY_US" in (
        ROOT / "src/pdcluster/worker/transfer/nixl_agent.py").read_text()
