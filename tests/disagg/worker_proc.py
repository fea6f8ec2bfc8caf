"""A worker as a real OS process for the fault tests: `python worker_proc.py MODEL ROLE PORT BLOCK_SIZE`.

Built exactly like the in-process harness workers (the same app and routes `pdcluster serve` mounts), so
the fault tests do not depend on the serve CLI's flag plumbing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import uvicorn  # noqa: E402
from harness import make_worker  # noqa: E402

if __name__ == "__main__":
    model, role, port, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    app, _ = make_worker(Path(model), role, block_size=block, num_kv_blocks=512)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
