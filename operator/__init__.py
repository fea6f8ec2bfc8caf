"""pdcluster.operator: the kopf operator, the PDCluster CRD models and the P:D autoscaler.

Importing this package never imports torch (the operator image installs the base dependencies only).
Submodules:

- `models`     pydantic models of the PDCluster spec (the CRD schema is generated from them, `crd`)
- `planner`    the pure P:D formula, clamps, budgets and the KV-cache budget
- `autoscaler` the pure decision function (stability rules, learned capacities)
- `render`     pure functions: spec -> Deployments/Services/ConfigMap/Secret/PDBs/NetworkPolicy
- `status`     pure status/conditions computation
- `promsource` the Prometheus metrics source (prometheus-api-client)
- `kube`       a thin Kubernetes API client (server-side apply)
- `reconcile`  one reconcile pass (async), used by the kopf handlers in `handlers`
"""
