"""kopf handlers: thin. They decide *when* to reconcile; `reconcile.reconcile` decides *what*.

- `on.create` / `on.update` (spec changes) / `on.resume` (operator restart): reconcile now. API errors
  become `kopf.TemporaryError` with exponential backoff, so kopf retries; a 409 re-reads and retries once.
- a per-PDCluster resync task: the periodic, level-triggered resync (drift correction for every child, the
  autoscaler's interval) and the consumer of "kicks". It is our own asyncio task, started and stopped by
  an `on.event` handler on PDClusters, not a `kopf.daemon`: kopf puts a finalizer on every object that has
  a daemon or timer (hard-wired in kopf 1.45), and a finalizer that only a running operator removes leaves
  PDClusters (and their namespaces) Terminating forever once the operator is uninstalled. The operator
  has nothing to clean up on deletion (owner references garbage-collect the children), so it uses no
  finalizer; it still *removes* the `pdcluster.dev/finalizer` that older versions added.
- `on.event` for the operator's Deployments and Services: any change or deletion of a child kicks its
  owner's resync task, so a hand-edited or deleted child is restored within about a second.
- nothing is reconciled while a PDCluster has `metadata.deletionTimestamp` (see `reconcile`).
- `on.startup` configures kopf (annotation-based state under pdcluster.dev/, no CRD scanning, only
  WARNING+ kopf logs become Events) and opens the API client; `on.cleanup` stops the resync tasks and
  closes the client.

Run with `pdcluster operator` (see `cli`), or `kopf run -m pdcluster.operator.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, cast

import httpx
import kopf

from pdcluster.operator import models, naming, opmetrics, peering
from pdcluster.operator import reconcile as rec
from pdcluster.operator.kube import PDC_API_VERSION, ApiError, Kube, bearer_token, load_configuration

GROUP, VERSION, PLURAL = models.API_GROUP, models.API_VERSION, models.PLURAL
KICK_DEBOUNCE_SECONDS = 0.5
LEGACY_FINALIZER = "pdcluster.dev/finalizer"
WATCH_SERVER_TIMEOUT = 120  # s, an int (sent as ?timeoutSeconds=): kopf watches PDClusters, children, peering
CONNECT_TIMEOUT = 15.0
REQUEST_TIMEOUT = 60.0


class _Runtime:
    """Process-wide state, (re)created on each operator startup (tests start several in one process)."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.http: httpx.AsyncClient | None = None
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self.kicks: dict[tuple[str, str], asyncio.Event] = {}
        self.resync_seconds: float = rec.RESYNC_SECONDS
        self.tasks: dict[tuple[str, str], tuple[asyncio.Task[None], asyncio.Event]] = {}
        self.peering: peering.Peering | None = None  # set by `pdcluster operator --peering`

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())

    def kick(self, namespace: str, name: str) -> asyncio.Event:
        return self.kicks.setdefault((namespace, name), asyncio.Event())

    def start_resync(self, namespace: str, name: str, delay: float, logger: Any) -> bool:
        """Start the PDCluster's resync task unless one is running; True if started."""
        key = (namespace, name)
        running = self.tasks.get(key)
        if running is not None and not running[0].done():
            return False
        stop = asyncio.Event()
        task = asyncio.create_task(_resync_loop(name, namespace, stop, logger, self.kick(namespace, name), delay),
                                   name=f"pdcluster resync {namespace}/{name}")
        self.tasks[key] = (task, stop)

        def forget(t: asyncio.Task[None]) -> None:
            if self.tasks.get(key, (None,))[0] is t:
                del self.tasks[key]
                self.kicks.pop(key, None)

        task.add_done_callback(forget)
        return True

    async def stop_resync(self, namespace: str, name: str, timeout: float = 1.0) -> None:
        """Ask the resync task to stop; cancel it if it has not stopped within `timeout` seconds."""
        running = self.tasks.get((namespace, name))
        if running is None:
            return
        task, stop = running
        stop.set()
        self.kick(namespace, name).set()  # wake it now
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.stop_resync(ns, name) for ns, name in list(self.tasks)))


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
    # No handler here needs a finalizer (no kopf.daemon/timer, no on.delete), so kopf adds none. Naming
    # the one older versions added lets kopf remove it from existing PDClusters ("no handlers require it").
    settings.persistence.finalizer = LEGACY_FINALIZER
    settings.posting.level = logging.WARNING  # our own Events are explicit; no "handler succeeded" noise
    settings.scanning.disabled = True  # no CRD watching: less RBAC, resources are fixed
    settings.execution.max_workers = 4
    # A watch with no client-side timeout waits forever on a connection that died without a FIN or RST
    # (a NAT or conntrack entry dropped, a proxy restarted): the operator would look healthy and never see
    # a PDCluster again. The server ends each watch after WATCH_SERVER_TIMEOUT (kopf resumes it from the
    # last resourceVersion, no relist); the client gives up a silent one a little later and reconnects.
    settings.watching.server_timeout = WATCH_SERVER_TIMEOUT
    settings.watching.client_timeout = WATCH_SERVER_TIMEOUT + 30
    settings.watching.connect_timeout = CONNECT_TIMEOUT
    settings.networking.connect_timeout = CONNECT_TIMEOUT
    settings.networking.request_timeout = REQUEST_TIMEOUT  # kopf's own PATCHes and Events (default 300 s)
    global RUNTIME
    resync, peer = RUNTIME.resync_seconds, RUNTIME.peering
    RUNTIME = _Runtime()
    RUNTIME.resync_seconds, RUNTIME.peering = resync, peer
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
    await RUNTIME.stop_all()
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
        if fresh is None or rec.is_deleting(fresh):
            return None  # gone, or going: never re-apply children of a PDCluster being deleted
        body = fresh
        for attempt in range(2):
            try:
                return await rec.reconcile(ctx, body, trigger)
            except ApiError as e:
                if e.status == 409 and attempt == 0:
                    fresh = await ctx.kube.get(PDC_API_VERSION, models.KIND, namespace, name)
                    if fresh is None or rec.is_deleting(fresh):
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


def _initial_delay(spec: Any) -> float:
    delay = RUNTIME.resync_seconds
    auto = (spec or {}).get("autoscaling") or {}
    if auto.get("enabled") and isinstance(auto.get("intervalSeconds"), int | float) and auto["intervalSeconds"] > 0:
        delay = min(delay, float(auto["intervalSeconds"]))
    return delay


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track_pdcluster(type: str | None, body: kopf.Body, name: str, namespace: str | None, logger: Any,
                          **_: Any) -> None:
    """Start the resync task when a PDCluster appears (listing, creation, any later event while it has
    none), stop it when the PDCluster is marked for deletion or gone."""
    namespace = namespace or "default"
    if type == "DELETED" or rec.is_deleting(_plain(body)):
        await RUNTIME.stop_resync(namespace, name)
        opmetrics.forget_conditions(namespace, name)
        return
    if RUNTIME.kube is not None:
        RUNTIME.start_resync(namespace, name, _initial_delay(body.get("spec")), logger)


async def _resync_loop(name: str, namespace: str, stopped: asyncio.Event, logger: Any,
                       kick: asyncio.Event, delay: float) -> None:
    """Reconcile every `delay` seconds or when kicked, until stopped or the PDCluster is gone or deleting."""
    failures = 0
    standby = False
    while not stopped.is_set():
        waiters = {asyncio.ensure_future(kick.wait()), asyncio.ensure_future(stopped.wait())}
        try:
            await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            for w in waiters:
                with contextlib.suppress(asyncio.CancelledError):
                    await w
        if stopped.is_set():
            break
        trigger = "child" if kick.is_set() else "resync"
        if kick.is_set():
            await asyncio.sleep(KICK_DEBOUNCE_SECONDS)  # coalesce bursts of child events
        kick.clear()
        if stopped.is_set() or RUNTIME.kube is None:
            break
        try:
            if RUNTIME.peering is not None and not await peering.active(RUNTIME.kube, RUNTIME.peering, namespace):
                if not standby:
                    logger.info("standby: another operator replica is active; resync of %s/%s paused",
                                namespace, name)
                standby, delay = True, RUNTIME.resync_seconds
                continue
            standby = False
            out = await _reconcile_locked({"metadata": {"name": name, "namespace": namespace}},
                                          trigger=trigger, retry=failures)
            if out is None:
                return  # the PDCluster is gone or being deleted
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
        except Exception:  # never let one bad pass kill the loop (cancellation is not an Exception)
            failures += 1
            delay = min(60.0, 2.0 ** min(failures, 6))
            logger.exception("resync of %s/%s crashed; retrying in %.0fs", namespace, name, delay)


def _owner_of(body: Any) -> str | None:
    for ref in (body.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == models.KIND and ref.get("controller") and \
                str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return ref.get("name")
    return None


@kopf.on.event("apps", "v1", "deployments", labels=naming.CHILD_LABELS)
@kopf.on.event("", "v1", "services", labels=naming.CHILD_LABELS)
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
