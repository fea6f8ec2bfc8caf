"""Pure: a pool's user pod options (`env`, `affinity`, `priorityClassName`, `podAnnotations`,
`imagePullSecrets`) merged into the pod spec and template annotations the operator renders.

The operator's own settings win where the two meet: its environment variables are refused by the spec
(models.RESERVED_ENV), and its annotations (config hash, secret hash, scrape hints) override a user's
annotation of the same key, so that a rollout on config change and the scrape config cannot be disabled
by accident.
"""

from __future__ import annotations

from typing import Any

from pdcluster.operator.models import PodOptions


def apply_pod_options(opts: PodOptions, pod_spec: dict[str, Any], container: dict[str, Any],
                      annotations: dict[str, str]) -> dict[str, str]:
    """Mutate `pod_spec` and `container` (freshly rendered, owned by the caller); return the template
    annotations: the user's first, the operator's over them."""
    if opts.env:
        container["env"] = [*container.get("env", []), *(e.model_dump(exclude_none=True) for e in opts.env)]
    if opts.affinity:
        pod_spec["affinity"] = dict(opts.affinity)
    if opts.priorityClassName:
        pod_spec["priorityClassName"] = opts.priorityClassName
    if opts.imagePullSecrets:
        pod_spec["imagePullSecrets"] = [{"name": s.name} for s in opts.imagePullSecrets]
    return {**opts.podAnnotations, **annotations}
