import pytest

from pdcluster.worker.engine.parallel.heads import check_layout, kv_heads_of_rank, ranks_holding_head


@pytest.mark.parametrize("kv_heads,tp", [(8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (1, 4), (4, 4)])
def test_every_head_is_held_and_ranks_hold_equal_counts(kv_heads: int, tp: int) -> None:
    check_layout(kv_heads, kv_heads * 4, tp)
    held = [kv_heads_of_rank(kv_heads, tp, r) for r in range(tp)]
    assert len({len(h) for h in held}) == 1
    assert sorted({h for r in held for h in r}) == list(range(kv_heads))
    for h in range(kv_heads):
        assert ranks_holding_head(kv_heads, tp, h)


def test_replicated_heads_go_to_consecutive_ranks() -> None:
    assert [list(kv_heads_of_rank(2, 4, r)) for r in range(4)] == [[0], [0], [1], [1]]
    assert ranks_holding_head(2, 4, 1) == [2, 3]


def test_split_heads_are_contiguous() -> None:
    assert [list(kv_heads_of_rank(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize(
    "kv_heads,heads,tp,word",
    [
        (8, 16, 3, "attention head"),
        (6, 12, 4, "KV head count"),
        (3, 12, 4, "KV head count"),
        (8, 16, 0, ">= 1"),
    ],
)
def test_bad_layouts_are_refused_with_the_reason(kv_heads: int, heads: int, tp: int, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        check_layout(kv_heads, heads, tp)


def test_rank_and_head_bounds() -> None:
    with pytest.raises(ValueError):
        kv_heads_of_rank(8, 2, 2)
    with pytest.raises(ValueError):
        ranks_holding_head(8, 2, 8)
