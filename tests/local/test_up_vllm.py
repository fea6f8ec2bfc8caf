"""`pdcluster up --engine vllm` for real: vLLM prefill and decode workers (vLLM's OpenAI server, NixlConnector
over UCX on loopback) from the vLLM environment, behind our router speaking vLLM's kv_transfer_params
handshake. Greedy output through the router equals one plain vLLM server on the same tiny random Llama, the
prompts above the disaggregation threshold really went prefill -> decode (the decode worker's NIXL transfer
counter and the router's count say so), the pods' preStop drain reads both workers idle afterwards (no KV left
held for a decode read), a killed prefill worker costs no request, and SIGTERM stops every process.

Skipped only when the vLLM environment is absent (`scripts/setup.sh vllm` builds it; `make test` does). Two
vLLM workers take ~10 GiB and minutes to start on a small machine: this is the slowest test of the suite."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdcluster.worker.local import vllm_workers
from pdcluster.worker.local.launcher import port_in_use

from ..netutil import free_block

needs_vllm = pytest.mark.skipif(vllm_workers.missing_reason() is not None, reason=str(vllm_workers.missing_reason()))

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + ",
           "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n" * 2,
           "x = 1"]  # the last is below the threshold: decode alone
THRESHOLD = 16
MAX_TOKENS = 24


def _free_ports(workers: int = 2) -> int:
    """A block for the router and `workers` workers whose NIXL side-channel ports are free too."""
    while True:
        port = free_block(workers + 1)
        if not any(port_in_use("127.0.0.1", port + i + vllm_workers.SIDE_CHANNEL_OFFSET)
                   for i in range(1, workers + 1)):
            return port


class Up:
    def __init__(self, model: Path, port: int, decode: int = 1) -> None:
        self.port = port
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdcluster", "up", "--engine", "vllm", "--model", str(model), "--prefill", "1",
             "--decode", str(decode), "--port", str(port), "--disaggregation-threshold", str(THRESHOLD),
             "--max-model-len", "512", "--start-timeout", str(vllm_workers.START_TIMEOUT)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines: list[str] = []

    def wait_line(self, pattern: str) -> bool:
        """Reads `up`'s output until a line matches or `up` exits (its own --start-timeout bounds the wait)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if re.search(pattern, line):
                return True
        return False

    def log_tails(self, n: int = 40) -> str:
        """The last `n` lines of each worker's log (`up` names the folder), for a failure's message."""
        m = re.search(r"^\s+logs in (\S+)", "".join(self.lines), re.M)
        if m is None:
            return "(no log folder in up's output)"
        return "".join(f"\n--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-n:])
                       for f in sorted(Path(m.group(1)).glob("*.log")))

    def pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+pid (\d+)", "".join(self.lines), re.M)}


def started_up(tmp_path_factory: pytest.TempPathFactory, decode: int = 1) -> Iterator[Up]:
    """`pdcluster up --engine vllm` on a tiny Llama with one prefill and `decode` decode workers, stopped after."""
    from pdcluster.worker.local.demo_model import build_demo_model

    model = build_demo_model(tmp_path_factory.mktemp("vllm") / "tiny", num_hidden_layers=2, hidden_size=128,
                             intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512)
    u = Up(model, _free_ports(1 + decode), decode=decode)
    try:
        yield u
    finally:
        if u.proc.poll() is None:
            u.proc.send_signal(signal.SIGTERM)
            u.proc.wait(120)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    yield from started_up(tmp_path_factory)


def _completion(url: str, model: str, prompt: str, **kw: object) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _placed(before: dict, after: dict) -> dict[tuple[str, str], int]:
    """The router's placements (pdcluster_router_placements_total, in /cluster) between two snapshots."""
    def counts(snap: dict) -> dict[tuple[str, str], int]:
        return {(p["placement"], p["reason"]): p["count"] for p in snap["router"]["placements"]}

    b, a = counts(before), counts(after)
    return {k: n - b.get(k, 0) for k, n in a.items() if n != b.get(k, 0)}


def _sample(url: str, name: str) -> float:
    """The sum of the samples named exactly `name` (a counter's `_total`, a histogram's `_count`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10, headers={"Accept": "text/plain"}).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


@pytest.mark.slow
@pytest.mark.timeout(3 * 900)  # vLLM starts in minutes under load: `up --start-timeout` bounds it, not pytest's 300 s
@needs_vllm
def test_router_over_vllm_workers_is_greedy_equal_to_one_vllm_server(up: Up) -> None:
    assert up.wait_line(r"^ready: "), "".join(up.lines)
    router = f"http://127.0.0.1:{up.port}"
    prefill, decode = (f"http://127.0.0.1:{up.port + i}" for i in (1, 2))
    model = httpx.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model == "tiny"  # the folder's name, as our engine serves it
    pids = up.pids()
    argv = open(f"/proc/{pids['prefill-0']}/cmdline").read().split("\0")
    assert vllm_workers.VLLM_MODULE in argv and "NixlConnector" in argv[argv.index("--kv-transfer-config") + 1]

    # the reference: one plain vLLM server (the prefill worker, asked directly: no kv_transfer_params). The decode
    # worker has not seen the prompts, so through the router it computes nothing of them but what NIXL brings.
    want = [_completion(prefill, model, p)["choices"][0]["text"] for p in PROMPTS]
    before = httpx.get(f"{router}/cluster", timeout=10).json()
    got = [_completion(router, model, p)["choices"][0]["text"] for p in PROMPTS]
    assert got == want
    # streamed through the router: the same text, event by event
    with httpx.stream("POST", f"{router}/v1/completions", timeout=300,
                      json={"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert text == want[0]
    # the two long prompts (and the streamed one) went prefill -> decode, or, while the router had the prefill
    # worker out of rotation (its /health late twice on a starved box), to the decode worker alone, which the
    # router counts as (aggregated, no_prefill); the short one went to decode alone as a short prompt
    after = httpx.get(f"{router}/cluster", timeout=10).json()
    placed, why = _placed(before, after), lambda: json.dumps(after, indent=1) + up.log_tails()
    handed = after["router"]["vllm_disaggregated"] - before["router"]["vllm_disaggregated"]
    assert placed.get(("aggregated", "short_prompt")) == 1, why()
    assert handed == placed.get(("disaggregated", "prompt_length"), 0), why()
    assert handed + placed.get(("aggregated", "no_prefill"), 0) == 3, why()
    for _ in range(30):  # none handed over (the prefill worker out the whole time): long prompts until the
        if handed:       # router reports one handed over (each answer is its event; the probe re-admits it)
            break
        assert _completion(router, model, PROMPTS[1])["choices"][0]["text"] == want[1]
        handed = httpx.get(f"{router}/cluster", timeout=10).json()["router"]["vllm_disaggregated"] - \
            before["router"]["vllm_disaggregated"]
    assert handed >= 1, why()
    # and the decode worker pulled their KV over NIXL (one read per request handed over), none failed
    assert _sample(decode, "vllm:nixl_xfer_time_seconds_count") >= handed
    assert _sample(decode, "vllm:nixl_num_failed_transfers_total") == 0
    # the pods' preStop drain reads both live workers as idle now: no request and no KV block held
    from pdcluster.operator.render_vllm import DRAIN_SCRIPT

    for worker in (prefill, decode):
        drained = subprocess.run([sys.executable, "-c", DRAIN_SCRIPT, "120", f"{worker}/metrics"], timeout=180)
        assert drained.returncode == 0, worker
    # bad input is the client's 400, not a 500
    r = httpx.post(f"{router}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1}, timeout=60)
    assert r.status_code == 400, r.text

    # a prefill worker that dies costs no request: its leg fails over (or the router already dropped it), and the
    # prompt is served by the decode worker alone, still greedy-equal
    os.killpg(os.getpgid(pids["prefill-0"]), signal.SIGKILL)  # the worker and its engine processes, as a pod dies
    assert _completion(router, model, PROMPTS[1])["choices"][0]["text"] == want[1]

    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(120) == 0
    for name, pid in pids.items():
        assert name == "prefill-0" or not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_missing_environment_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "PDCLUSTER_VLLM_PYTHON": str(tmp_path / "nope" / "python")}
    r = subprocess.run([sys.executable, "-m", "pdcluster", "up", "--engine", "vllm", "--port", str(free_block(3))],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "scripts/setup.sh vllm" in r.stderr, r.stderr
