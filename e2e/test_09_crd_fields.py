"""The CRD fields of issue 14 on a real API server: per-pool pod options are accepted, stored and
rendered by the operator into that pool's pods; the operator's own env names, value+valueFrom, empty
names are refused (CEL and schema); `spec.image` may be omitted; `kubectl explain` documents the fields;
`kubectl get pdc` has the Degraded column."""

from __future__ import annotations

import pytest
from pdc_e2e import Kube, condition, example_pdc, wait_until

from pdcluster.operator import models

OPTIONS = {
    "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "MY_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
    "priorityClassName": "system-cluster-critical",
    "podAnnotations": {"team": "llm"},
    "imagePullSecrets": [{"name": "registry"}],
    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}]}},
}

BAD = [
    ("reserved-env", {"decode": {"env": [{"name": "POD_IP", "value": "x"}]}}, "must not set a variable"),
    ("two-sources", {"router": {"env": [{"name": "A", "value": "1",
                                         "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]}},
     "mutually exclusive"),
    ("empty-priority-class", {"prefill": {"priorityClassName": ""}}, "spec.prefill.priorityClassName"),
    ("bad-env-name", {"prefill": {"env": [{"name": "1A", "value": "x"}]}}, "spec.prefill.env[0].name"),
    ("empty-image", {"image": ""}, "spec.image"),
]


@pytest.mark.parametrize("overrides,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_pod_options_refused(kube: Kube, helm_release: dict[str, str], namespace: str,
                                 overrides: dict, needle: str):
    cp = kube.apply(example_pdc("bad", **overrides), ns=namespace, check=False)
    assert cp.returncode != 0 and needle in cp.stderr, cp.stderr


def test_pod_options_reach_the_pods(kube: Kube, operator, namespace: str):
    doc = example_pdc("opts", decode=OPTIONS)
    doc["spec"].pop("image", None)  # the operator's own worker image
    kube.apply(doc, ns=namespace)
    dep = wait_until("the decode Deployment", lambda: kube.get("deployment", "opts-decode", namespace),
                     timeout=60)
    pod = dep["spec"]["template"]["spec"]
    (ctr,) = pod["containers"]
    assert ctr["image"] == models.DEFAULT_WORKER_IMAGE
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["affinity"] == OPTIONS["affinity"]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in ctr["env"]
    assert dep["spec"]["template"]["metadata"]["annotations"]["team"] == "llm"
    prefill = kube.get("deployment", "opts-prefill", namespace)
    assert "priorityClassName" not in prefill["spec"]["template"]["spec"]
    # a flipped pod would keep decode's env, affinity and priority in the prefill pool: no role flips, and the
    # RoleFlips condition says why (the operator starts pods instead)
    flips = wait_until("the RoleFlips condition", lambda: condition(kube.get("pdc", "opts", namespace),
                                                                    "RoleFlips"), timeout=60)
    assert (flips["status"], flips["reason"]) == ("False", "PodSpecsDiffer"), flips
    assert all(f in flips["message"] for f in ("env", "affinity", "priorityClassName")), flips
    assert "PodSpecsDiffer" in kube.run("describe", "pdc", "opts", "-n", namespace).stdout


def test_explain_and_printer_columns(kube: Kube, helm_release: dict[str, str], namespace: str):
    text = kube.run("explain", "pdcluster.spec.decode.env").stdout
    assert "Extra environment variables" in text and "valueFrom" in text
    kube.apply(example_pdc("cols"), ns=namespace)
    header = kube.run("get", "pdc", "-n", namespace).stdout.splitlines()[0].split()
    assert "DEGRADED" in header
