"""pdcluster.operator: the kopf operator, the PDCluster CRD models and the P:D autoscaler.

Importing this package never imports torch (the operator image installs the base dependencies only).
Submodules:

- `models`     pydantic models of the PDCluster spec (the CRD schema is generated from them, `crd`)
- `planner`    the pure P:D formula, the one replica clamp, budgets and the KV-cache budget
- `autoscaler` the pure decision function `decide` (stability rules, learned capacities)
- `scaling`    the scaling step of a reconcile pass (spec replicas, hold, or an autoscaler evaluation)
- `naming`     child names, labels, owner references (the only place that spells a label)
- `render`     pure functions: spec -> Deployments/Services/ConfigMap/Secret (`policies`: PDBs/NetworkPolicy)
- `status`     pure status shaping: conditions, replicas, status.autoscaler <-> the autoscaler's state
- `promsource` the Prometheus metrics source (prometheus-api-client)
- `kube`       a thin Kubernetes API client (server-side apply)
- `reconcile`  one reconcile pass (async), used by the kopf handlers in `handlers`
"""
