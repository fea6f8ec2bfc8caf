"""kopf handlers: thin. They decide *when* to reconcile; `reconcile.reconcile` decides *what*.

- `on.create` / `on.update` (spec changes) / `on.resume` (operator restart): reconcile now. API errors
  become `kopf.TemporaryError` with exponential backoff, so kopf retries; a 409 re-reads and retries once.
- a per-PDCluster `daemon`: the periodic, level-triggered resync (drift correction for every child, the
  autoscaler's interval) and the consumer of "kicks".
- `on.event` for the operator's Deployments and Services: any change or deletion of a child kicks its
  owner's daemon, so a hand-edited or deleted child is restored within about a second.
- `on.startup` configures kopf (annotation-based state under pdcluster.dev/, no CRD scanning, only
  WARNING+ kopf logs become Events) and opens the API client; `on.cleanup` closes it.

Run with `pdcluster operator` (see `cli`), or `kopf run -m pdcluster.operator.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

import httpx
import kopf
from pdcluster.operator import models
from pdcluster.operator import reconcile as rec
from pdcluster.operator.kube import PDC_API_VERSION, ApiError, Kube, bearer_token, load_configuration

GROUP, VERSION, PLURAL = models.API_GROUP, models.API_VERSION, models.PLURAL
CHILD_LABELS = {"app.kubernetes.io/name": "pdcluster", "app.kubernetes.io/managed-by": "pdcluster-operator"}
KICK_DEBOUNCE_SECONDS = 0.5


class _Runtime:
    """Process-wide state, (re)created on each operator startup (tests start several in one process)."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.http: httpx.AsyncClient | None = None
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.kicks: dict[tuple[str, str], asyncio.Event] = {}
        self.resync_seconds: float = rec.RESYNC_SECONDS

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def kick(self, namespace: str, name: str) -> asyncio.Event:
        return self.kicks.setdefault((namespace, name), asyncio.Event())


RUNTIME = _Runtime()


def _emit(body: dict[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(cast(Any, body), type=type_, reason=reason, message=message[:1000])


def _context() -> rec.Context:
    if RUNTIME.kube is None:
        raise kopf.TemporaryError("API client not initialised yet", delay=1)
    return rec.Context(kube=RUNTIME.kube, emit=_emit, http=RUNTIME.http, resync_seconds=RUNTIME.resync_seconds)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, logger: Any, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="pdcluster.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="pdcluster.dev", key="last-handled-configuration")
    # kopf adds this finalizer because of the per-object daemon; it is removed when the daemon stops.
    settings.persistence.finalizer = "pdcluster.dev/finalizer"
    settings.posting.level = logging.WARNING  # our own Events are explicit; no "handler succeeded" noise
    settings.scanning.disabled = True  # no CRD watching: less RBAC, resources are fixed
    settings.execution.max_workers = 4
    global RUNTIME
    resync = RUNTIME.resync_seconds
    RUNTIME = _Runtime()
    RUNTIME.resync_seconds = resync
    RUNTIME.kube = await Kube.from_environment()
    RUNTIME.http = httpx.AsyncClient(trust_env=False)  # pod IPs: never through an HTTP proxy
    logger.info("pdcluster operator: API server %s, resync every %ss", RUNTIME.kube.host, resync)


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """The same credentials as our own API client (in-cluster, else $KUBECONFIG read at login time)."""
    try:
        cfg = load_configuration()
    except Exception as e:
        raise kopf.LoginError(f"no Kubernetes credentials: {e}") from e
    scheme, token = bearer_token(cfg)
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        trust_env=settings.networking.trust_env,
    )


@kopf.on.cleanup()
async def close(**_: Any) -> None:
    if RUNTIME.kube is not None:
        await RUNTIME.kube.close()
    if RUNTIME.http is not None:
        await RUNTIME.http.aclose()


async def _reconcile_locked(body: dict[str, Any], trigger: str, retry: int = 0) -> rec.Outcome | None:
    ctx = _context()
    meta = body["metadata"]
    namespace, name = meta.get("namespace"), meta["name"]
    async with RUNTIME.lock(namespace, name):
        # Reconcile what the API server holds now, not kopf's copy: another pass may have just written
        # the status (conditions, autoscaler state), and Events are emitted on status transitions.
        try:
            fresh = await ctx.kube.get(PDC_API_VERSION, models.KIND, namespace, name)
        except ApiError as e:
            raise kopf.TemporaryError(f"Kubernetes API error, will retry: {e}",
                                      delay=min(60.0, 2.0 ** min(retry, 6))) from e
        if fresh is None:
            return None
        body = fresh
        for attempt in range(2):
            try:
                return await rec.reconcile(ctx, body, trigger)
            except ApiError as e:
                if e.status == 409 and attempt == 0:
                    fresh = await ctx.kube.get(PDC_API_VERSION, models.KIND, namespace, name)
                    if fresh is None:
                        return None
                    body = fresh
                    continue
                raise kopf.TemporaryError(f"Kubernetes API error, will retry: {e}",
                                          delay=min(60.0, 2.0 ** min(retry, 6))) from e
    return None


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def reconcile_pdcluster(body: kopf.Body, reason: Any, retry: int, **_: Any) -> None:
    await _reconcile_locked(_plain(body), trigger=str(reason), retry=retry)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=1.0)
async def resync(name: str, namespace: str | None, stopped: kopf.DaemonStopped, logger: Any, spec: Any,
                 **_: Any) -> None:
    namespace = namespace or "default"
    kick = RUNTIME.kick(namespace, name)
    delay = RUNTIME.resync_seconds
    auto = (spec or {}).get("autoscaling") or {}
    if auto.get("enabled") and isinstance(auto.get("intervalSeconds"), int | float):
        delay = min(delay, float(auto["intervalSeconds"]))
    try:
        await _resync_loop(name, namespace, stopped, logger, kick, delay)
    except asyncio.CancelledError:
        return  # the operator is exiting or the PDCluster is gone: nothing to clean up


async def _resync_loop(name: str, namespace: str, stopped: kopf.DaemonStopped, logger: Any,
                       kick: asyncio.Event, delay: float) -> None:
    failures = 0

    async def stop_wait() -> None:
        await stopped.wait()

    while not stopped:
        waiters = {asyncio.ensure_future(kick.wait()), asyncio.ensure_future(stop_wait())}
        try:
            await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            for w in waiters:
                with contextlib.suppress(asyncio.CancelledError):
                    await w
        if stopped:
            break
        trigger = "child" if kick.is_set() else "resync"
        if kick.is_set():
            await asyncio.sleep(KICK_DEBOUNCE_SECONDS)  # coalesce bursts of child events
        kick.clear()
        if stopped or RUNTIME.kube is None:
            break
        try:
            out = await _reconcile_locked({"metadata": {"name": name, "namespace": namespace}},
                                          trigger=trigger, retry=failures)
            if out is None:
                return  # the PDCluster is gone
            delay = out.next_delay
            failures = 0
        except kopf.TemporaryError as e:
            failures += 1
            delay = float(e.delay or 5.0)
            logger.warning("resync of %s/%s failed, retrying in %.0fs: %s", namespace, name, delay, e)
        except ApiError as e:
            failures += 1
            delay = min(60.0, 2.0 ** min(failures, 6))
            logger.warning("resync of %s/%s failed, retrying in %.0fs: %s", namespace, name, delay, e)
        except Exception:  # never let one bad pass kill the loop
            failures += 1
            delay = min(60.0, 2.0 ** min(failures, 6))
            logger.exception("resync of %s/%s crashed; retrying in %.0fs", namespace, name, delay)


def _owner_of(body: Any) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == models.KIND and ref.get("controller") and \
                str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return ref.get("name")
    return None


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
@kopf.on.event("", "v1", "services", labels=CHILD_LABELS)
async def child_changed(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    owner = _owner_of(body)
    if owner and namespace:
        RUNTIME.kick(namespace, owner).set()


def _plain(body: Any) -> dict[str, Any]:
    def conv(x: Any) -> Any:
        if hasattr(x, "items"):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [conv(v) for v in x]
        return x

    return conv(body)
