"""Build step of docker/worker-vllm.Dockerfile and scripts/setup-vllm.sh (the host's vLLM environment that
`pdcluster up --engine vllm` runs): let the environment set NIXL's progress-thread delay.

NIXL's Python agent (nixl._api.nixl_agent, which vLLM's NixlConnector creates in every worker) hard-codes
`pthrDelay = 0`. Its UCX backend waits for work with poll(worker fds, timeout = that delay rounded up to
milliseconds), so 0 makes the progress thread spin: one CPU of each vLLM pod busy forever, idle or not (measured
on the e2e node: ~90% of a core per pod, strace showing poll/epoll_wait with timeout 0 in a loop). A delay
lets the thread sleep in poll() until UCX signals an event on the worker's fd (a transfer, a notification),
so the delay only bounds how long a transport that needs periodic polling waits. This rewrites that one line
to read PDCLUSTER_NIXL_PROGRESS_DELAY_US, the knob our own engine's agents read (worker/transfer/nixl_agent.py),
with the same default (100 microseconds; 0 = NIXL's own busy polling), and fails the build when the line is
found neither as NIXL ships it nor already rewritten, so a NIXL upgrade that moves it is noticed here.
"""

from __future__ import annotations

import compileall
import inspect
import pathlib

import nixl._api as api

path = pathlib.Path(inspect.getsourcefile(api.nixl_agent) or "")
text = path.read_text()
old = "agent_config.pthrDelay = 0"
DEFAULT_US = "100"  # = pdcluster.worker.transfer.nixl_agent.PROGRESS_DELAY_US (checked by tests/test_image_names.py)
new = f'agent_config.pthrDelay = int(__import__("os").environ.get("PDCLUSTER_NIXL_PROGRESS_DELAY_US", "{DEFAULT_US}"))'
if text.count(new) == 1 and old not in text:  # rewritten before (setup-vllm.sh on an existing environment)
    raise SystemExit(0)
if text.count(old) != 1:
    raise SystemExit(f"{path}: expected one {old!r} (NIXL changed?): revisit docker/nixl-progress-delay.py")
path.write_text(text.replace(old, new))
compileall.compile_file(str(path), quiet=1, force=True)
print(f"{path}: pthrDelay from PDCLUSTER_NIXL_PROGRESS_DELAY_US (default {DEFAULT_US} us)")
