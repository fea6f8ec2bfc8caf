"""Per-pool pod options (env, affinity, priorityClassName, podAnnotations, imagePullSecrets) and the
default image: accepted by the models, rendered into the pool's Deployment only, and unable to override
what the operator itself sets."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from pydantic import ValidationError

from pdcluster import __version__
from pdcluster.operator import models, naming, render
from pdcluster.operator.models import parse_spec

OWNER = naming.Owner(name="llama", namespace="inference", uid="0000-1111")
FP = render.secret_fingerprint(b"k" * 32)
BASE: dict[str, Any] = {"model": {"name": "m", "uri": "file:///m"}, "image": "img:1"}
AFFINITY = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}
OPTIONS: dict[str, Any] = {
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
    "affinity": AFFINITY,
    "priorityClassName": "inference-high",
    "podAnnotations": {"team": "llm", "prometheus.io/scrape": "false"},
    "imagePullSecrets": [{"name": "registry"}],
}


def _deployments(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    objs = render.render_children(OWNER, parse_spec(spec), {"prefill": 1, "decode": 1}, FP)
    return {o["metadata"]["name"].rsplit("-", 1)[1]: o for o in objs if o["kind"] == "Deployment"}


@pytest.mark.parametrize("pool", ["prefill", "decode", "router"])
def test_pool_options_render_into_that_pool_only(pool: str) -> None:
    spec = {**copy.deepcopy(BASE), pool: copy.deepcopy(OPTIONS)}
    plain = _deployments(copy.deepcopy(BASE))
    for role, dep in _deployments(spec).items():
        tpl = dep["spec"]["template"]
        pod, (ctr,) = tpl["spec"], tpl["spec"]["containers"]
        if role != pool:
            assert dep == plain[role], f"{pool}'s options leaked into {role}"
            continue
        assert pod["affinity"] == AFFINITY
        assert pod["priorityClassName"] == "inference-high"
        assert pod["imagePullSecrets"] == [{"name": "registry"}]
        env = {e["name"]: e for e in ctr["env"]}
        assert env["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "1"}
        assert env["TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        # the operator's variables come first and are all still there
        own = [e["name"] for e in plain[role]["spec"]["template"]["spec"]["containers"][0]["env"]]
        assert [e["name"] for e in ctr["env"]][: len(own)] == own
        ann = tpl["metadata"]["annotations"]
        assert ann["team"] == "llm"
        # the operator's scrape hint and hashes win over a user's annotation of the same key
        assert ann["prometheus.io/scrape"] == "true"
        assert {k: v for k, v in ann.items() if k != "team"} == plain[role]["spec"]["template"]["metadata"][
            "annotations"]


def test_pod_options_do_not_change_the_process_config() -> None:
    """Placement and environment are the Deployment's: the ConfigMap the processes read is unchanged."""
    spec = {**copy.deepcopy(BASE), "router": copy.deepcopy(OPTIONS)}
    cm = render.render_config_map(OWNER, parse_spec(spec))
    assert cm == render.render_config_map(OWNER, parse_spec(copy.deepcopy(BASE)))


@pytest.mark.parametrize("name", sorted(models.RESERVED_ENV))
def test_env_cannot_shadow_the_operators_variables(name: str) -> None:
    with pytest.raises(ValidationError, match=name):
        parse_spec({**BASE, "decode": {"env": [{"name": name, "value": "x"}]}})


@pytest.mark.parametrize("bad", [
    {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
    {"env": [{"name": "", "value": "1"}]},
    {"env": [{"name": "1BAD", "value": "1"}]},
    {"env": [{"value": "1"}]},
    {"priorityClassName": ""},
    {"imagePullSecrets": [{}]},
    {"podAnnotations": {"a": 1}},
])
def test_bad_pod_options_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        parse_spec({**BASE, "prefill": bad})


def test_image_defaults_to_the_worker_image_of_this_version() -> None:
    spec = {k: v for k, v in BASE.items() if k != "image"}
    assert parse_spec(spec).image is None
    assert models.DEFAULT_WORKER_IMAGE == f"pdcluster/worker:{__version__}"
    for dep in _deployments(spec).values():
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == models.DEFAULT_WORKER_IMAGE
    for dep in _deployments(copy.deepcopy(BASE)).values():
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1"
    with pytest.raises(ValidationError):
        parse_spec({**BASE, "image": ""})


def test_default_worker_image_is_the_one_the_build_makes() -> None:
    """One image name across the tree: the image e2e/images.sh builds from docker/worker.Dockerfile."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    assert f'WORKER_IMAGE="{models.WORKER_IMAGE_REPOSITORY}:$VERSION"' in (root / "e2e" / "images.sh").read_text()
    assert f"-t {models.WORKER_IMAGE_REPOSITORY}:" in (root / "docker" / "worker.Dockerfile").read_text()
