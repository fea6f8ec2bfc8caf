"""Error paths (ValueError naming the argument), backend selection, cache allocation and sizing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdcluster.kernels import (
    allocate_kv_cache,
    kv_bytes_per_token,
    paged_decode_attention,
    resolve_backend,
    write_kv_cache,
)


def good(kv_dtype: str = "auto", head_dim: int = 32, block_size: int = 8) -> dict:
    kc, vc, ks, vs = allocate_kv_cache(4, block_size, 2, head_dim, kv_dtype, torch.float32)
    return dict(q=torch.randn(2, 4, head_dim), k_cache=kc, v_cache=vc,
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([3, 9], dtype=torch.int32), k_scale=ks, v_scale=vs)


def attn(backend: str = "torch", kv_dtype: str = "auto", **override):
    args = good(kv_dtype) | override
    return paged_decode_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                  args.pop("block_tables"), args.pop("seq_lens"), backend=backend, **args)


ATTENTION_ERRORS = [
    ("q", dict(q=torch.randn(2, 4))),
    ("q", dict(q=torch.zeros(2, 4, 32, dtype=torch.int32))),
    ("q", dict(q=torch.randn(2, 3, 32))),  # heads not a multiple of kv_heads
    ("k_cache", dict(k_cache=torch.zeros(4, 8, 2))),
    ("k_cache", dict(k_cache=torch.zeros(4, 8, 2, 16), v_cache=torch.zeros(4, 8, 2, 16))),  # head_dim
    ("k_cache", dict(k_cache=torch.zeros(4, 8, 2, 32, dtype=torch.int16),
                     v_cache=torch.zeros(4, 8, 2, 32, dtype=torch.int16))),
    ("k_cache", dict(k_cache=torch.zeros(4, 8, 2, 32, device="meta"))),  # device
    ("v_cache", dict(v_cache=torch.zeros(4, 8, 2, 32, dtype=torch.float16))),
    ("v_cache", dict(v_cache=torch.zeros(5, 8, 2, 32))),
    ("block_tables", dict(block_tables=torch.zeros(2, 2, dtype=torch.int64))),
    ("block_tables", dict(block_tables=torch.zeros(3, 2, dtype=torch.int32))),
    ("seq_lens", dict(seq_lens=torch.tensor([3, 9]))),  # int64
    ("seq_lens", dict(seq_lens=torch.tensor([3, 17], dtype=torch.int32))),  # > 2 blocks x 8
    ("seq_lens", dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32))),
    ("k_scale", dict(k_scale=torch.ones(4, 8, 2))),  # scales on a float cache
    ("backend", dict(backend="cuda")),
]


@pytest.mark.parametrize(("arg", "override"), ATTENTION_ERRORS)
def test_attention_errors_name_the_argument(arg, override):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        attn(**override)


@pytest.mark.parametrize(("arg", "override"), [
    ("k_scale", dict(k_scale=None)),
    ("v_scale", dict(v_scale=torch.ones(4, 8, 2, dtype=torch.float16))),
    ("v_scale", dict(v_scale=torch.ones(4, 8, 3))),
])
def test_quantized_cache_scale_errors(arg, override):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        attn(kv_dtype="int8", **override)


def test_backend_resolution(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"^backend\b"):
        resolve_backend("triton", cpu)
    with pytest.raises(ValueError, match=r"^backend\b"):
        resolve_backend("Torch", cpu)


WRITE_ERRORS = [
    ("k", dict(k=torch.randn(3, 32))),
    ("k", dict(k=torch.randn(3, 1, 32), v=torch.randn(3, 1, 32))),  # kv_heads mismatch with cache
    ("v", dict(v=torch.randn(3, 2, 16))),
    ("slot_mapping", dict(slot_mapping=torch.zeros(3))),
    ("slot_mapping", dict(slot_mapping=torch.zeros(4, dtype=torch.int64))),
    ("slot_mapping", dict(slot_mapping=torch.tensor([0, 1, 32]))),  # 4 blocks x 8 = 32 slots
    ("k_cache", dict(k_cache=torch.zeros(4, 8, 2, 16), v_cache=torch.zeros(4, 8, 2, 16))),
]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
@pytest.mark.parametrize(("arg", "override"), WRITE_ERRORS)
def test_write_errors_name_the_argument(backend, arg, override):
    kc, vc, _, _ = allocate_kv_cache(4, 8, 2, 32, "auto", torch.float32)
    args = dict(k=torch.randn(3, 2, 32), v=torch.randn(3, 2, 32), k_cache=kc, v_cache=vc,
                slot_mapping=torch.tensor([0, 1, 2])) | override
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        write_kv_cache(args["k"], args["v"], args["k_cache"], args["v_cache"], args["slot_mapping"],
                       backend=backend)


def test_allocate_kv_cache_shapes():
    kc, vc, ks, vs = allocate_kv_cache(5, 16, 4, 64, "auto", torch.float16)
    assert kc.shape == vc.shape == (5, 16, 4, 64) and kc.dtype == torch.float16 and ks is None and vs is None
    kc, vc, ks, vs = allocate_kv_cache(5, 16, 4, 64, "int8")
    assert kc.dtype == torch.int8 and kc.shape == (5, 16, 4, 64) and ks.shape == (5, 16, 4)
    kc, vc, ks, vs = allocate_kv_cache(5, 16, 4, 64, "int4")
    assert kc.dtype == torch.uint8 and kc.shape == (5, 16, 4, 32) and vs.dtype == torch.float32
    with pytest.raises(ValueError, match=r"^kv_dtype\b"):
        allocate_kv_cache(5, 16, 4, 64, "fp8")
    with pytest.raises(ValueError, match=r"^head_dim\b"):
        allocate_kv_cache(5, 16, 4, 0)


def test_kv_bytes_per_token():
    # 70B-class: 80 layers x 8 kv heads x 128 dims x 2 (K, V) x 2 bytes.
    assert kv_bytes_per_token(8, 128, "auto", torch.float16, layers=80) == 80 * 8 * 128 * 2 * 2
    assert kv_bytes_per_token(8, 128, "int8") == 2 * 8 * (128 + 4)
    assert kv_bytes_per_token(8, 128, "int4") == 2 * 8 * (64 + 4)
    assert kv_bytes_per_token(1, 64, "auto", torch.float32) == 2 * 64 * 4


def test_import_does_not_import_triton():
    code = "import sys, pdcluster.kernels; assert 'triton' not in sys.modules, 'triton imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.triton)])
def test_corrupt_block_table_never_reads_out_of_bounds(backend):
    """Table values are not host-checked (that would sync on CUDA): a bad id gives a wrong row, not a fault."""
    out = attn(backend=backend, block_tables=torch.tensor([[0, 10**6], [-5, 3]], dtype=torch.int32))
    assert out.shape == (2, 4, 32) and torch.isfinite(out).all()
