"""Issue 38 row 7 at the router: a request stands in its queue as the sequences it costs (prompts x n), not as
one request, so `n: 128` cannot slip in under a bound meant for 16 requests."""

from __future__ import annotations

import pytest

from pdcluster.worker.api.errors import APIError
from pdcluster.worker.router.app import RouterState, Tracker
from pdcluster.worker.router.front_door import sequences
from pdcluster.worker.router.options import RouterOptions
from pdcluster.worker.router.pool import Pool


def state(depth: int) -> RouterState:
    pool = Pool(decode_urls=["http://decode:1"])
    for w in pool.workers.values():
        w.healthy = True
    return RouterState(pool, RouterOptions(max_queue_depth=depth, disaggregation_threshold=0, max_retries=1))


def test_sequences_of_a_body() -> None:
    assert sequences({"prompt": "a"}) == 1
    assert sequences({"prompt": "a", "n": 8}) == 8
    assert sequences({"prompt": ["a", "b", "c"], "n": 2}) == 6
    assert sequences({"prompt": [[1, 2], [3]], "n": 4}) == 8
    assert sequences({"prompt": [1, 2, 3], "n": 2}) == 2  # one prompt of token ids
    assert sequences({"messages": [], "n": "lots"}) == 1  # malformed: the worker's validation refuses it


def test_the_queue_counts_sequences() -> None:
    st = state(4)
    with pytest.raises(APIError) as e:
        st.admit(5)  # more than the whole queue: it can never be admitted, a 400 naming n
    assert e.value.status == 400 and e.value.param == "n"
    t = Tracker(st, 0.0, cost=3)
    assert st.waiting == 3
    st.admit(1)
    with pytest.raises(APIError) as e:
        st.admit(2)  # 3 + 2 > 4
    assert e.value.status == 429
    t.done()
    assert st.waiting == 0 and st.in_flight == 0
    st.admit(4)
