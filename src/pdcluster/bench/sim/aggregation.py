"""Load-driven aggregation in the simulated cluster (`ServiceModel.aggregate_ttft_s` > 0, `simulate
--load-aggregation`): the router's own decision (`worker/router/aggregate.py`, hysteresis included) at each
arrival. It sees the prefill queue as the prompt tokens admitted and not yet prefilled, shared over the serving
prefill instances, at `prefill_tps`. When that misses the target and a decode instance has a free batch slot
(nothing queued for decode, no local prefill under way there), that instance prefills the prompt itself at
`prefill_tps`: its batch makes no progress meanwhile (the interference disaggregation avoids; the engine's
mixed steps slow decoding instead of stopping it, so this is the pessimistic side), then the request decodes
there. KV memory is not modelled (batch slots only). Counted as the router counts them
(`Counters.load_aggregated`, which the autoscaler reads; `RunResult.aggregated`)."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from pdcluster.worker.router import aggregate as agg

if TYPE_CHECKING:
    from pdcluster.bench.sim.cluster import Cluster, Instance

LOCAL_DONE = 7  # the event: a decode instance finished prefilling a prompt itself (cluster.py's event kinds)


def place(c: Cluster, rid: int, now: float) -> bool:
    """The router's placement of a newly admitted request: True when a decode instance prefills it."""
    if c.m.aggregate_ttft_s <= 0:
        return False
    n_p = c.pools["prefill"].ready_count()
    tokens = c.reqs[rid].input_tokens
    backlog = agg.PrefillBacklog(c.pqueued_tokens // n_p if n_p else 1 << 40, c.m.prefill_tps)
    decode_waiting = len(c.dqueue) - c.dhead
    ds = sorted((i for i in c.pools["decode"].instances if i.serving), key=lambda i: i.n)
    # KV is not modelled: every candidate has the room (0 blocks needed, 0 free)
    cands = [agg.DecodeSlack(str(k), 0, 0, i.n, decode_waiting + (i.last > now), c.m.decode_batch, c.m.prefill_tps)
             for k, i in enumerate(ds)]
    placed = agg.decide(tokens, backlog, cands, c.m.aggregate_ttft_s, c.agg_engaged)
    c.agg_engaged = placed.engaged
    if not placed.aggregate or placed.decode is None:
        return False
    d = ds[int(placed.decode)]
    c.advance(d, now)
    d.n += 1  # its slot from now; its batch waits while it prefills (the clock resumes at d.last)
    d.last = max(d.last, now) + tokens / c.m.prefill_tps
    c.c.load_aggregated += 1  # the router's placements counter (load rule), which the autoscaler reads too
    c.push(d.last, LOCAL_DONE, d, rid)
    c.reschedule(d, now)
    return True


def local_done(c: Cluster, d: Instance, rid: int, now: float) -> None:
    """A prompt prefilled on decode instance `d`: its first token now, then it decodes there."""
    c.first[rid] = now
    c.sampler.ttft.append((now, now - c.reqs[rid].t))
    c.pending_first -= 1
    c.c.generated += 1
    if c.out[rid] == 1:
        c.finish(rid, now)
        d.n -= 1
        if d.draining and d.n == 0:
            c.retire(d, now)
        c.decode_dispatch(now)
    else:
        c.advance(d, now)
        heapq.heappush(d.fin, (d.v + c.out[rid] - 1, rid))
    c.reschedule(d, now)
