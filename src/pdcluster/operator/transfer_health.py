"""Pure: the `KVTransferDegraded` condition from the KV transfer series the autoscaler already reads.

A prefill->decode KV transfer that fails (save on prefill, load on decode: `pdcluster_kv_transfer_failures_total`
on either role) leaves the decode worker without the prompt's KV: the router then retries the request on
another pair, prefilling the prompt again, or the request fails. Either way it is a silent slowdown unless
it is said: True when more than `DEGRADED_SHARE` of the window's transfers failed (the same share as the
`PDClusterKVTransferFailures` alert), False when transfers succeed (or none ran), Unknown when the series
are missing. Runbook: docs/runbooks/PDClusterKVTransferFailures.md.
"""

from __future__ import annotations

import math
from typing import Any

from pdcluster.operator import status as st
from pdcluster.operator.autoscaler import Observation

CONDITION = "KVTransferDegraded"
DEGRADED_SHARE = 0.01


def failure_share(ok: float | None, failed: float | None) -> float | None:
    """failed / (ok + failed) over the window; 0 with no transfers at all; None when a series is missing."""
    if ok is None or failed is None or not (math.isfinite(ok) and math.isfinite(failed)):
        return None
    total = max(0.0, ok) + max(0.0, failed)
    return max(0.0, failed) / total if total > 0 else 0.0


def condition(obs: Observation | None) -> dict[str, Any]:
    if obs is None:
        return st.condition(CONDITION, "Unknown", "MetricsUnavailable", "no metrics for the window")
    ok, failed = obs.kv_transfers_per_second, obs.kv_transfer_failures_per_second
    share = failure_share(ok, failed)
    if share is None:
        if ok is not None and failed is None:  # a counter appears with its first failure
            return st.condition(CONDITION, False, "TransfersHealthy", f"{ok:.3g} KV transfers/s, none failed")
        return st.condition(CONDITION, "Unknown", "NoTransferSeries",
                            "no pdcluster_kv_transfer_* series for this PDCluster in the window")
    rate = f"{failed:.3g} of {(ok or 0.0) + (failed or 0.0):.3g} transfers/s"
    if share > DEGRADED_SHARE:
        return st.condition(CONDITION, True, "TransfersFailing",
                            f"{100 * share:.1f} % of KV transfers failed ({rate}): decode never got those prompts' "
                            "KV, so the router prefilled them again on another pair or they failed")
    if (ok or 0.0) + (failed or 0.0) == 0:
        return st.condition(CONDITION, False, "NoTransfers", "no KV transfers in the window")
    return st.condition(CONDITION, False, "TransfersHealthy", f"{100 * share:.2f} % of KV transfers failed ({rate})")
