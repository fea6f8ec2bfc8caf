"""Real-node scenario: the worker pods run the native CPU kernels the image was built with.

The pods have a read-only root filesystem and no compiler, so before the image carried prebuilt kernels
(docker/worker.Dockerfile's `kernels` stage, `PDCLUSTER_NATIVE_PREBUILT`) every pod ran the 2-3x slower
torch path and said so only in a log line. The node is this machine, so its CPU decides whether they can run.
"""

from __future__ import annotations

import pytest
from node_e2e import assert_route_to, dump, http_json, http_text, metric_sum, pods, port_forward
from pdc_e2e import Kube

from pdcluster.kernels import native

PROMPT = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly"


def test_worker_pods_load_the_images_prebuilt_native_kernels(kube: Kube, app_ns: str, example_name: str):
    reason = native.unrunnable_reason()
    if reason is not None:
        pytest.skip(f"this node's CPU cannot run the native kernels ({reason}): the pods rightly use torch")
    name = example_name
    try:
        with port_forward(kube, app_ns, f"svc/{name}-router", 8000) as port:
            model = http_json(f"http://127.0.0.1:{port}/v1/models")["data"][0]["id"]
            out = http_json(f"http://127.0.0.1:{port}/v1/completions",
                            {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert out["usage"]["completion_tokens"] > 0, out
        (decode, *_) = pods(kube, app_ns, f"app.kubernetes.io/instance={name},pdcluster.dev/role=decode")
        ip = decode["status"]["podIP"]
        assert_route_to(ip)  # the hard network rule, checked before each request to a pod address
        # the pool counts every native kernel call; the series is only non-zero once the module ran
        text = http_text(f"http://{ip}:8000/metrics")
        calls = metric_sum(text, "pdcluster_native_pool_calls_total")
        # and the series an SRE alerts on (0 would mean the torch path)
        loaded = [line for line in text.splitlines() if line.startswith("pdcluster_native_kernel_loaded{")]
        assert any('kernel="pdc_step"' in line and line.endswith(" 1.0") for line in loaded), loaded
        logs = kube.run("logs", "-n", app_ns, decode["metadata"]["name"], check=False).stdout
        lines = [line for line in logs.splitlines() if "native CPU kernel pdc_step" in line]
        assert lines and "/opt/pdcluster/native-kernels/" in lines[0] and "(prebuilt)" in lines[0], lines
        assert calls > 0, calls
    except BaseException:
        print(dump(kube, app_ns))
        raise
