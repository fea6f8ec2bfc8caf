"""The pure parts of tensor parallelism: each rank's local config, how each checkpoint tensor is sliced (the
slices of all ranks put back together give the whole tensor, fused q/k/v and gate/up included), and the step
message a follower rebuilds its batch from."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdcluster.worker.engine.config import ModelConfig
from pdcluster.worker.engine.parallel import step
from pdcluster.worker.engine.parallel.heads import kv_heads_of_rank
from pdcluster.worker.engine.parallel.shard import check_tp, local_config, slice_weight
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.engine.scheduler import Batch
from pdcluster.worker.engine.sequence import Sequence


def cfg(heads: int = 4, kv: int = 2, inter: int = 128, vocab: int = 250, d: int = 8) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "llama", "vocab_size": vocab, "hidden_size": heads * d,
                                  "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": heads,
                                  "num_key_value_heads": kv})


@pytest.mark.parametrize("tp,kv_local", [(1, 2), (2, 1), (4, 1)])
def test_local_config(tp: int, kv_local: int) -> None:
    local = local_config(cfg(), tp, tp - 1)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4 // tp, kv_local, 128 // tp)
    assert local.vocab_size == -(-250 // tp) and local.head_dim == 8 and local.hidden_size == 32
    assert local.tp_full == cfg() and (local.tp_rank, local.tp_size) == (tp - 1, tp)


@pytest.mark.parametrize("tp,needle", [(3, "attention head count 4"), (8, "attention head count 4"),
                                       (0, ">= 1")])
def test_sizes_that_do_not_fit(tp: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        check_tp(cfg(), tp)
    with pytest.raises(ValueError, match="MLP intermediate size 130"):
        check_tp(cfg(inter=130), 4)


def _rows_by_rank(name: str, t: torch.Tensor, full: ModelConfig, tp: int, dim: int = 0) -> list[torch.Tensor]:
    return [slice_weight(name, t, local_config(full, tp, r)) for r in range(tp)]


@pytest.mark.parametrize("tp", [2, 4])
def test_slices_cover_the_whole_tensor(tp: int) -> None:
    full = cfg()
    d, h = full.head_dim, full.hidden_size
    q, k = torch.randn(full.num_heads * d, h), torch.randn(full.num_kv_heads * d, h)
    # q and o_proj: disjoint head slices, in order
    assert torch.equal(torch.cat(_rows_by_rank("layers.0.self_attn.q_proj.weight", q, full, tp)), q)
    o = torch.randn(h, full.num_heads * d)
    assert torch.equal(torch.cat(_rows_by_rank("layers.1.self_attn.o_proj.weight", o, full, tp), 1), o)
    # k: each rank holds exactly its heads per heads.kv_heads_of_rank (replicated when kv < tp)
    for r, part in enumerate(_rows_by_rank("layers.0.self_attn.k_proj.weight", k, full, tp)):
        heads = kv_heads_of_rank(full.num_kv_heads, tp, r)
        assert torch.equal(part, k[heads.start * d : heads.stop * d])
    # o_proj's bias is added once (rank 0), after the row-parallel sum
    b = torch.randn(h)
    biases = _rows_by_rank("layers.0.self_attn.o_proj.bias", b, full, tp)
    assert torch.equal(biases[0], b) and all(not x.any() for x in biases[1:])
    # MLP: gate/up rows, down columns
    gate, down = torch.randn(128, h), torch.randn(h, 128)
    assert torch.equal(torch.cat(_rows_by_rank("layers.0.mlp.gate_proj.weight", gate, full, tp)), gate)
    assert torch.equal(torch.cat(_rows_by_rank("layers.0.mlp.down_proj.weight", down, full, tp), 1), down)
    # vocabulary: padded with zero rows up to a multiple of tp, never anything else
    emb = torch.randn(250, h)
    parts = _rows_by_rank("embed_tokens.weight", emb, full, tp)
    assert {p.shape[0] for p in parts} == {-(-250 // tp)} and torch.equal(torch.cat(parts)[:250], emb)
    assert not torch.cat(parts)[250:].any()
    # replicated: norms, and MoE experts (same-named gate_proj, but under mlp.experts)
    norm, expert = torch.randn(h), torch.randn(128, h)
    assert all(p is norm for p in _rows_by_rank("layers.0.input_layernorm.weight", norm, full, tp))
    assert all(p is expert for p in _rows_by_rank("layers.0.mlp.experts.3.gate_proj.weight", expert, full, tp))


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_checkpoint_slices_match_separate_ones(tp: int) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused: each rank's fused slice is its q, k, v (gate, up) slices."""
    full = cfg()
    d, h = full.head_dim, full.hidden_size
    q, k, v = torch.randn(4 * d, h), torch.randn(2 * d, h), torch.randn(2 * d, h)
    gate, up = torch.randn(128, h), torch.randn(128, h)
    fused_cfg = dataclasses.replace(full, model_type="phi3")
    for r in range(tp):
        local = local_config(fused_cfg, tp, r)
        sep = [slice_weight(f"layers.0.self_attn.{n}_proj.weight", t, local) for n, t in (("q", q), ("k", k), ("v", v))]
        fused = slice_weight("layers.0.self_attn.qkv_proj.weight", torch.cat((q, k, v)), local)
        assert torch.equal(fused, torch.cat(sep))
        gu = slice_weight("layers.0.mlp.gate_up_proj.weight", torch.cat((gate, up)), local)
        want = torch.cat([slice_weight(f"layers.0.mlp.{n}_proj.weight", t, local) for n, t in (("gate", gate),
                                                                                                  ("up", up))])
        assert torch.equal(gu, want)


def test_step_message_rebuilds_what_the_runner_reads() -> None:
    a, b = Sequence("a", list(range(1, 21)), SamplingParams()), Sequence("b", [5, 6, 7], SamplingParams())
    a.num_computed_tokens, a.block_table = 8, [3, 9, 4]
    b.block_table = [7]
    prefill = step.decode(step.encode(Batch([a, b], [12, 3], True, [("in", [1], [3])])))
    assert prefill.is_prefill and prefill.num_new_tokens == [12, 3] and prefill.copies == [("in", [1], [3])]
    for got, want, n in zip(prefill.seqs, [a, b], [12, 3], strict=True):
        start = want.num_computed_tokens
        assert len(got) == len(want) and got.num_computed_tokens == start and got.block_table == want.block_table
        assert got.token_ids[start : start + n] == want.token_ids[start : start + n]
    a.token_ids.append(42)
    a.num_computed_tokens = 20
    dec = step.decode(step.encode(Batch([a], [1], False)))
    assert len(dec.seqs[0]) == 21 and dec.seqs[0].last_token_id == 42 and dec.seqs[0].block_table == [3, 9, 4]
