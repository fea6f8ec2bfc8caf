"""Real-node scenarios with `spec.engine: vllm` (docs/vllm.md): one PDCluster whose prefill and decode pods run
vLLM's OpenAI server from `pdcluster/worker-vllm` (NixlConnector over UCX/TCP between the pods) behind our router
(`--engine vllm`), shared by the three scenarios so that vLLM's start is paid once:

a. served through the router Service, greedy token-for-token equal to one plain vLLM server on the same model:
   the host's vLLM environment (`scripts/setup.sh vllm`) run here before the PDCluster exists, so the two never
   share the memory; the long prompts went prefill pod -> NIXL -> decode pod (router and decode pod counters);
b. decode 1 -> 2 -> 1 under continuous traffic whose every answer equals the reference: 0 failed requests;
c. a prefill pod deleted while it holds KV that a decode pod has not read yet (a prefill leg sent by hand, as the
   router sends it): its preStop drain keeps it serving until the decode pod has pulled that KV, the decode leg
   answers the reference's tokens with no failed transfer, the hook exits 0 (no FailedPreStopHook), and the
   router's traffic meanwhile loses nothing.

Every wait is on a state the system reports (pod readiness and deletion, the router's /cluster, the pods' vLLM
/metrics, Events); the timeouts only bound failures. vLLM's KV lease (30 s, kv_lease_duration) bounds how long
the prefill pod of scenario c holds the KV for the decode leg: the test sends it right after the deletion."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from node_e2e import (
    CLUSTER_DIR,
    NODE_NAME,
    assert_route_to,
    dump,
    free_port,
    http_json,
    http_text,
    metric_sum,
    pods,
    port_forward,
    ready,
)
from pdc_e2e import Kube, example_pdc, wait_ready, wait_until

from pdcluster.worker.local import vllm_workers
from pdcluster.worker.router.vllm_pd import REMOTE_DECODE

# The first test also pays the module's fixtures: the reference server's and the PDCluster's vLLM starts (minutes
# each on the shared 2-core node), beyond make e2e's 600 s per test.
pytestmark = pytest.mark.timeout(1800)

NAME = "tiny-vllm"
SERVED = "tiny-vllm-model"  # spec.model.name: what clients send (not the folder's name)
MAX_MODEL_LEN = 512
MAX_BATCH_SIZE = 8
MAX_BATCH_TOKENS = 1024
THRESHOLD = 16  # router.disaggregationThreshold: prompts of at least this many tokens go prefill -> decode
MAX_TOKENS = 16
LONG = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
        "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"]
SHORT = ["x = 1"]
# what the continuous traffic of scenarios b and c sends, in turn (short and long prompts)
TRAFFIC = ["count: " + " ".join(str(n) for n in range(k * 4 + 2)) for k in range(7)]
# vLLM on CPU: 1 GiB of KV per pod (each pod is ~5 GiB of RSS besides; the node's 24 GiB are shared)
KV_GIB = "1"
RESOURCES = {"requests": {"cpu": "500m", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
ROLE = "app.kubernetes.io/instance={name},pdcluster.dev/role={role}"


def _sel(role: str) -> str:
    return ROLE.format(name=NAME, role=role)


def _live(kube: Kube, ns: str, role: str) -> list[dict[str, Any]]:
    return [p for p in pods(kube, ns, _sel(role)) if not p["metadata"].get("deletionTimestamp")]


def _pod_url(pod: dict[str, Any]) -> str:
    ip = pod["status"]["podIP"]
    assert_route_to(ip)  # the hard network rule, before each request to a pod address
    return f"http://{ip}:8000"


def _metric(pod: dict[str, Any], name: str) -> float:
    return metric_sum(http_text(f"{_pod_url(pod)}/metrics"), name)


def _complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return http_json(f"{url}/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                                               **extra}, timeout=180)


def _answer(r: dict[str, Any]) -> tuple[list[int], str]:
    c = r["choices"][0]
    return list(c["token_ids"]), str(c["text"])


@pytest.fixture(scope="module")
def vllm_model() -> Path:
    """A tiny random Llama on the node's filesystem, readable by the pods' uid 65532 (mounted by hostpath://)."""
    from pdcluster.worker.local.demo_model import build_demo_model

    folder = CLUSTER_DIR / "hostpath-models" / "vllm-tiny"
    if not (folder / "model.safetensors").is_file():
        build_demo_model(folder, seed=11, num_hidden_layers=2, hidden_size=128, intermediate_size=256,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN)
    for p in [folder, *folder.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return folder


@contextlib.contextmanager
def _host_vllm(model: Path) -> Iterator[str]:
    """One plain vLLM server (no KV connector) from the host's vLLM environment, on loopback, with the pods'
    engine settings (context, batch limits, KV space, no thread binding)."""
    reason = vllm_workers.missing_reason()
    if reason and os.environ.get("PDCLUSTER_SKIP_VLLM"):  # the user left vLLM out of `scripts/setup.sh test`
        pytest.skip(f"PDCLUSTER_SKIP_VLLM is set: {reason}")
    if reason:
        pytest.fail(f"the reference vLLM server cannot run: {reason}")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_GIB, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_NO_USAGE_STATS": "1"}
    log_path = CLUSTER_DIR.parent / "host-vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(vllm_workers.vllm_python()), "-m", vllm_workers.VLLM_MODULE, "--model", str(model),
             "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
             "--max-num-seqs", str(MAX_BATCH_SIZE), "--max-num-batched-tokens", str(MAX_BATCH_TOKENS),
             "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log"],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the reference vLLM server exited with {proc.returncode}; see {log_path}")
        try:
            http_text(f"{url}/health", timeout=3)
            return True
        except OSError:
            return False
    try:
        wait_until(f"the reference vLLM server (log {log_path})", up, timeout=900, interval=2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(vllm_model: Path) -> dict[tuple[str, int], tuple[list[int], str]]:
    """The plain server's greedy answers: (prompt, max_tokens) -> (token ids, text)."""
    t0 = time.monotonic()
    with _host_vllm(vllm_model) as url:
        started = time.monotonic() - t0
        want = {(p, MAX_TOKENS): _answer(_complete(url, p)) for p in LONG + SHORT}
        want.update({(p, 6): _answer(_complete(url, p, 6)) for p in TRAFFIC})
    print(f"\nreference vLLM server (host venv): ready after {started:.0f}s, {len(want)} answers, "
          f"{time.monotonic() - t0:.0f}s in all")
    return want


@pytest.fixture(scope="module")
def vllm_cluster(kube: Kube, app_ns: str, real_operator: dict[str, Any], vllm_model: Path,
                 reference: dict[tuple[str, int], tuple[list[int], str]]) -> Iterator[str]:
    pool = {"replicas": 1, "minReplicas": 1, "maxReplicas": 2, "maxBatchSize": MAX_BATCH_SIZE,
            "maxBatchTokens": MAX_BATCH_TOKENS, "resources": RESOURCES,
            "env": [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": KV_GIB}]}
    doc = example_pdc(NAME, engine="vllm",
                      model={"name": SERVED, "uri": f"hostpath://{vllm_model}", "dtype": "auto",
                             "maxModelLen": MAX_MODEL_LEN},
                      prefill=pool, decode=dict(pool),
                      kvTransfer={"integrity": "fabric"},
                      router={"disaggregationThreshold": THRESHOLD, "requestTimeoutSeconds": 120})
    t0 = time.monotonic()
    kube.apply(doc, ns=app_ns)
    try:
        wait_ready(kube, app_ns, NAME, timeout=1200)
        print(f"\nPDCluster {NAME} (engine vllm) Ready after {time.monotonic() - t0:.0f}s")
        yield app_ns
    except BaseException:
        print(dump(kube, app_ns))
        raise
    finally:
        kube.run("delete", "pdc", NAME, "-n", app_ns, "--wait=true", "--timeout=240s", check=False)


class CheckedTraffic:
    """One client through the router, back to back, cycling TRAFFIC; an answer differing from the reference is a
    failure like an error is (the scenarios assert there is none)."""

    def __init__(self, port: int, want: dict[tuple[str, int], tuple[list[int], str]]) -> None:
        self.port, self.want = port, want
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._check(TRAFFIC[i % len(TRAFFIC)])
            i += 1

    def _check(self, prompt: str) -> None:
        try:
            got = _answer(_complete(f"http://127.0.0.1:{self.port}", prompt, 6))
            if got == self.want[(prompt, 6)]:
                with self._lock:  # the client's thread and a burst's
                    self.ok += 1
            else:
                self.failures.append(f"{prompt!r}: {got} != {self.want[(prompt, 6)]}")
        except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test
            self.failures.append(f"{type(e).__name__}: {e}")

    def burst(self, n: int) -> bool:
        """n more requests at once beside the client (checked like its own); True once all have ended (so a wait
        condition can chain it)."""
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(self._check, TRAFFIC[:n]))
        return True

    def __enter__(self) -> CheckedTraffic:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=240)


# the preStop drain's reads of /metrics in vLLM's access log: from the pod's loopback (render_vllm.drain_command)
DRAIN_POLL = re.compile(r'127\.0\.0\.1:\d+ .*"GET /metrics ')


def _drain_polls(kube: Kube, ns: str, pod: str) -> bool:
    return bool(DRAIN_POLL.search(kube.run("logs", "-n", ns, pod, "--tail=400", check=False).stdout))


def _scale(kube: Kube, ns: str, role: str, n: int) -> None:
    kube.run("patch", "pdc", NAME, "-n", ns, "--type=merge", "-p", f'{{"spec":{{"{role}":{{"replicas":{n}}}}}}}')


def test_a_router_is_greedy_equal_to_one_vllm_server(kube: Kube, vllm_cluster: str,
                                                     reference: dict[tuple[str, int], tuple[list[int], str]]):
    ns = vllm_cluster
    try:
        (prefill,) = _live(kube, ns, "prefill")
        (decode,) = _live(kube, ns, "decode")
        for p in (prefill, decode):
            assert p["spec"]["nodeName"] == NODE_NAME
            c = p["spec"]["containers"][0]
            assert c["image"].startswith("pdcluster/worker-vllm:"), c["image"]
            assert c["command"][:3] == ["python3", "-m", vllm_workers.VLLM_MODULE], c["command"]
            assert "NixlConnector" in c["command"][c["command"].index("--kv-transfer-config") + 1]
            # the operator sized vLLM's OpenMP pool from the pool's CPU request (500m: 1 thread); the spec sets none
            assert [e.get("value") for e in c["env"] if e["name"] == "OMP_NUM_THREADS"] == ["1"], c["env"]
        xfers0 = _metric(decode, "vllm:nixl_xfer_time_seconds_count")
        with port_forward(kube, ns, f"svc/{NAME}-router", 8000) as port:
            router = f"http://127.0.0.1:{port}"
            assert [m["id"] for m in http_json(f"{router}/v1/models")["data"]] == [SERVED]
            before = http_json(f"{router}/cluster")
            got = {p: _complete(router, p) for p in LONG + SHORT}
            after = http_json(f"{router}/cluster")
        for p in LONG + SHORT:
            assert _answer(got[p]) == reference[(p, MAX_TOKENS)], (p, got[p], reference[(p, MAX_TOKENS)])
        for p in LONG:
            assert got[p]["usage"]["prompt_tokens"] >= THRESHOLD, got[p]["usage"]
        assert got[SHORT[0]]["usage"]["prompt_tokens"] < THRESHOLD, got[SHORT[0]]["usage"]
        # the long prompts (only they) went prefill pod -> decode pod, and the decode pod read their KV over NIXL;
        # a long prompt the router sent to the decode pod alone while it had no prefill pod in rotation (late
        # /health answers on a loaded node) is counted as (aggregated, no_prefill): explained, not lost
        assert after["router"]["engine"] == "vllm"
        placed = {(p["placement"], p["reason"]): p["count"] for p in after["router"]["placements"]}
        was = {(p["placement"], p["reason"]): p["count"] for p in before["router"]["placements"]}
        handed = after["router"]["vllm_disaggregated"] - before["router"]["vllm_disaggregated"]
        fallback = placed.get(("aggregated", "no_prefill"), 0) - was.get(("aggregated", "no_prefill"), 0)
        assert handed + fallback == len(LONG) and handed >= 1, after
        assert placed.get(("aggregated", "short_prompt"), 0) - was.get(("aggregated", "short_prompt"), 0) \
            == len(SHORT), after
        assert _metric(decode, "vllm:nixl_xfer_time_seconds_count") - xfers0 >= handed
        assert _metric(decode, "vllm:nixl_num_failed_transfers_total") == 0
        n, total = (_metric(decode, f"vllm:nixl_xfer_time_seconds_{k}") for k in ("count", "sum"))
        print(f"\nNIXL reads by the decode pod: {n:.0f}, mean {1000 * total / n:.1f} ms")
    except BaseException:
        print(dump(kube, ns))
        raise


def test_b_decode_one_two_one_under_traffic(kube: Kube, vllm_cluster: str,
                                            reference: dict[tuple[str, int], tuple[list[int], str]]):
    ns = vllm_cluster
    try:
        with port_forward(kube, ns, f"svc/{NAME}-router", 8000) as port, CheckedTraffic(port, reference) as traffic:
            (old,) = _live(kube, ns, "decode")
            t0 = time.monotonic()
            _scale(kube, ns, "decode", 2)
            two = wait_until("2 decode pods Ready", lambda: (ps := _live(kube, ns, "decode"))
                             and len(ps) == 2 and all(ready(p) for p in ps) and ps, timeout=900, interval=2)
            (new,) = [p for p in two if p["metadata"]["uid"] != old["metadata"]["uid"]]
            print(f"\ndecode 1->2: the new vLLM pod Ready after {time.monotonic() - t0:.0f}s")
            # one client back to back leaves both pods idle at each pick, and the router then breaks the tie by
            # address: concurrent requests spread by the router's own in-flight count, so the new pod gets some
            wait_until("the new decode pod to serve requests",
                       lambda: traffic.burst(4) and _metric(new, "vllm:request_success_total") > 0, timeout=300,
                       interval=1)
            ok_before_down = traffic.ok
            t1 = time.monotonic()
            _scale(kube, ns, "decode", 1)
            wait_until("1 decode pod left", lambda: len(pods(kube, ns, _sel("decode"))) == 1, timeout=300,
                       interval=2)
            print(f"decode 2->1: the drained pod gone after {time.monotonic() - t1:.0f}s")
            wait_until("traffic after the scale-down", lambda: traffic.ok > ok_before_down + 2, timeout=180)
        print(f"traffic: {traffic.ok} answers equal to the reference, {len(traffic.failures)} failures")
        assert traffic.ok > 10
        assert not traffic.failures, traffic.failures[:10]
    except BaseException:
        print(dump(kube, ns))
        raise


def test_c_prefill_pod_deleted_with_kv_in_flight(kube: Kube, vllm_cluster: str,
                                                 reference: dict[tuple[str, int], tuple[list[int], str]]):
    ns = vllm_cluster
    try:
        (prefill,) = _live(kube, ns, "prefill")
        (decode,) = _live(kube, ns, "decode")
        pname = prefill["metadata"]["name"]
        # the prefill leg, as the router sends it: the prefill pod computes the prompt's KV and keeps it for a
        # decode pod to read (kv_transfer_params say where). No other traffic yet: the decode pod's NIXL counters
        # below are this request's.
        prompt = LONG[0]
        leg = _complete(_pod_url(prefill), prompt, 1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
        params = leg["kv_transfer_params"]
        assert params and params.get("remote_host") == prefill["status"]["podIP"], leg
        wait_until("the prefill pod to report the KV it holds for the decode pod",
                   lambda: _metric(prefill, "vllm:kv_cache_usage_perc") > 0, timeout=20, interval=0.5)
        xfers0 = _metric(decode, "vllm:nixl_xfer_time_seconds_count")
        assert not _drain_polls(kube, ns, pname)
        t0 = time.monotonic()
        kube.run("delete", "pod", pname, "-n", ns, "--wait=false")
        gone = kube.get("pod", pname, ns)
        assert gone is not None and gone["metadata"].get("deletionTimestamp"), gone
        # the kubelet is stopping it: its preStop drain runs (the server logs the hook's reads of /metrics from
        # the pod's own loopback; the router's and the kubelet's come from other addresses), and the server
        # still answers and still holds the KV. Without the hook the kubelet's SIGTERM would have stopped vLLM
        # here and the KV with it.
        wait_until(f"the preStop drain of {pname} to run", lambda: _drain_polls(kube, ns, pname), timeout=60,
                   interval=0.5)
        assert _metric(prefill, "vllm:kv_cache_usage_perc") > 0
        got = _complete(_pod_url(decode), prompt, kv_transfer_params=params)
        assert _answer(got) == reference[(prompt, MAX_TOKENS)], (got, reference[(prompt, MAX_TOKENS)])
        # read over NIXL from the terminating pod, not recomputed
        assert _metric(decode, "vllm:nixl_xfer_time_seconds_count") > xfers0
        assert _metric(decode, "vllm:nixl_num_failed_transfers_total") == 0
        # router traffic while the drained pod finishes leaving (the router may still pick it until it sees it go)
        with port_forward(kube, ns, f"svc/{NAME}-router", 8000) as port, CheckedTraffic(port, reference) as traffic:
            wait_until(f"the drained prefill pod {pname} gone", lambda: kube.get("pod", pname, ns) is None,
                       timeout=300, interval=1)
            print(f"\nprefill pod deleted with KV held: drained and gone after {time.monotonic() - t0:.0f}s")
            ok_at_gone = traffic.ok
            wait_until("traffic after the prefill pod left", lambda: traffic.ok > ok_at_gone + 2, timeout=180)
        hooks = [e for e in kube.json("get", "events", "-n", ns, "--field-selector",
                                      f"involvedObject.name={pname}")["items"]
                 if e.get("reason") == "FailedPreStopHook"]
        assert not hooks, [e.get("message") for e in hooks]  # the drain ended on its own (exit 0), not given up
        print(f"traffic: {traffic.ok} answers equal to the reference, {len(traffic.failures)} failures")
        assert not traffic.failures, traffic.failures[:10]
    except BaseException:
        print(dump(kube, ns))
        raise
