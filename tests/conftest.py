"""Suite-wide setup. Area-specific fixtures live in tests/<area>/conftest.py."""

import os

# Triton kernels run on CPU through the interpreter; it must be chosen before triton is imported.
# On a CUDA machine the real compiler is used instead.
if not os.environ.get("PDCLUSTER_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The shape every area's tests share: GQA (4 heads over 2 KV heads), head_dim 16, 3 layers, a real
# byte-level BPE tokenizer (vocab 1024) with a chat template and an EOS id. Random weights.
TINY_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama HF folder with tokenizer (config.json, model.safetensors, tokenizer.json, ...)."""
    from pdcluster.worker.local.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("tiny-model"), **TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_model_dir_no_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape without tokenizer files: serves token-id prompts only (vocab 512, no EOS)."""
    from pdcluster.worker.local.demo_model import build_demo_model

    return build_demo_model(
        tmp_path_factory.mktemp("tiny-model-ids"), tokenizer=False, vocab_size=512, **TINY_MODEL
    )


@pytest.fixture
def tiny_engine_config(tiny_model_dir: Path):  # noqa: ANN201 - avoids importing torch at collection time
    """An EngineConfig for the tiny model with a small, fixed KV cache (256 blocks of 16)."""
    from pdcluster.worker.engine.llm_engine import EngineConfig

    return EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, num_threads=None)


# The quick tier (`make test-quick`) leaves out what starts a stack of processes: whole folders of real
# multi-process clusters, plus single files that launch a server or an operator as a child process.
STACK_FOLDERS = ("disagg", "engine_tp")
STACK_FILES = ("server/test_serve_cli.py", "operator/test_handlers_kmock.py", "bench/test_real_worker.py",
               "bench/test_cpu_limits.py", "local/test_restart_cgroup.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(here).as_posix()
        if rel.split("/")[0] in STACK_FOLDERS or rel in STACK_FILES:
            item.add_marker(pytest.mark.stack)
