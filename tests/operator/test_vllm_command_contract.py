"""The vLLM command lines we render (operator pods and `pdcluster up --engine vllm`) parse with vLLM's own
server parser and validation, run in the vLLM environment: a renamed or removed vLLM flag fails here, not in a
pod's crash loop. Skipped, saying why, when the vLLM environment is absent (`scripts/setup.sh vllm`)."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
from pathlib import Path

import pytest

from pdcluster.operator import render_vllm
from pdcluster.operator.models import parse_spec
from pdcluster.worker.local import vllm_workers

pytestmark = [pytest.mark.slow,  # each parse imports vLLM (~45 s on 2 cores)
              pytest.mark.skipif(vllm_workers.missing_reason() is not None, reason=str(vllm_workers.missing_reason()))]

# parse + validate only (no engine): what vLLM's api_server main() does before it starts anything
PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
print(json.dumps({k: getattr(args, k) for k in json.loads(sys.argv[2])}, default=str))
"""
KEYS = ["model", "served_model_name", "port", "host", "kv_transfer_config", "max_num_seqs",
        "max_num_batched_tokens", "tensor_parallel_size", "max_model_len", "dtype", "block_size",
        "gpu_memory_utilization", "enforce_eager"]
SPEC = {"model": {"name": "llama", "uri": "/models/llama", "maxModelLen": 4096, "dtype": "bfloat16"},
        "engine": "vllm", "kvTransfer": {"integrity": "fabric"},
        "prefill": {"tensorParallelSize": 2, "resources": {"limits": {"nvidia.com/gpu": 2}},
                    "engineArgs": ["--enforce-eager"], "maxBatchSize": 32, "maxBatchTokens": 4096}}


def _parse(argv: list[str]) -> dict:
    assert argv[1:3] == ["-m", render_vllm.VLLM_MODULE]
    r = subprocess.run([str(vllm_workers.vllm_python()), "-c", PARSE, json.dumps(argv[3:]), json.dumps(KEYS)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_operator_rendered_commands_parse_with_vllm() -> None:
    spec = parse_spec(copy.deepcopy(SPEC))
    gpu = _parse(render_vllm.vllm_command(spec, "prefill", "/models/llama"))
    assert gpu["served_model_name"] == ["llama"] and gpu["tensor_parallel_size"] == 2 and gpu["port"] == 8000
    assert (gpu["max_num_seqs"], gpu["max_num_batched_tokens"], gpu["max_model_len"]) == (32, 4096, 4096)
    assert gpu["enforce_eager"] is True and gpu["block_size"] == 16 and gpu["dtype"] == "bfloat16"
    assert "NixlConnector" in gpu["kv_transfer_config"] and "'cuda'" in gpu["kv_transfer_config"]
    cpu = _parse(render_vllm.vllm_command(spec, "decode", "/models/llama"))
    assert cpu["block_size"] is None and cpu["tensor_parallel_size"] == 1 and "'cpu'" in cpu["kv_transfer_config"]
    assert "kv_load_failure_policy='recompute'" in cpu["kv_transfer_config"]  # vLLM's field, by its own parser


def test_up_commands_parse_with_vllm(tmp_path: Path) -> None:
    args = argparse.Namespace(host="127.0.0.1", prefill_tp=1, decode_tp=1, max_model_len=512, threads=1)
    got = _parse(vllm_workers.worker_cmd(args, tmp_path / "tiny", "prefill", 18001))
    assert got["served_model_name"] == ["tiny"] and got["port"] == 18001 and got["max_model_len"] == 512


def test_vllm_example_commands_parse_with_vllm() -> None:
    """examples/pdcluster-vllm.yaml's pools (the user's own flags in engineArgs) render commands vLLM accepts."""
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples" / "pdcluster-vllm.yaml").read_text())
    spec = parse_spec(doc["spec"])
    got = _parse(render_vllm.vllm_command(spec, "decode", "/models/llama-3.1-8b-instruct"))
    assert got["served_model_name"] == ["llama-3.1-8b-instruct"] and got["max_num_seqs"] == 128
    assert got["max_model_len"] == 16384 and "'cuda'" in got["kv_transfer_config"]
