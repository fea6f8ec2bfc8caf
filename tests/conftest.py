"""Suite-wide setup. Area-specific fixtures live in tests/<area>/conftest.py."""

import os

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported.
# On a CUDA machine the real compiler is used instead.
if not os.environ.get("PDCLUSTER_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
