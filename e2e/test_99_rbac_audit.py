"""Last: across the whole run, the operator (authenticated as the chart's ServiceAccount) was never
denied an API call. A missing ClusterRole rule shows up here even when a retry papered over it."""

from __future__ import annotations

import re

from pdc_e2e import Operator

DENIED = re.compile(r"403 Forbidden|status=403|APIForbiddenError|\bforbidden\b", re.IGNORECASE)
# a 403 that is not about RBAC: writes into a namespace being deleted (the tests delete theirs)
NOT_RBAC = re.compile(r"NamespaceTerminating|because it is being terminated")


def test_operator_was_never_forbidden(operator: Operator):
    denied = [ln[:400] for ln in operator.all_logs().splitlines() if DENIED.search(ln) and not NOT_RBAC.search(ln)]
    assert not denied, "the operator was denied API calls (chart ClusterRole too narrow?):\n" + "\n".join(denied[:20])
