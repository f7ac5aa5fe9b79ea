"""A job's reconcile loop: the one place its failures are detected, restarts happen and
completion is noticed.

The loop wakes when a pod of the job or a Node it runs on changes (watch events poke its
:class:`~omni_operator.handlers.operator_state.Wakeup`), when the reconcile asked to look again
(a backoff, a node's grace or the hang timeout ends), and at the latest every resync period
(the trainer's progress is polled, not pushed); a job queued for capacity also wakes when any
job's pod changes. Bursts of events (512 pods turning Running) coalesce into one wake-up. Every
run is the same level-based :func:`~omni_operator.handlers.engine.reconcile_job` the create,
resume and update handlers call, serialized per job by its lock, so whichever comes first does
the work and the others find nothing to do.
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from omni_operator.handlers import engine
from omni_operator.handlers.operator_state import OperatorState, Wakeup

RETRY_SECONDS = 2.0  # after a reconcile failed (API server unreachable)


async def run_job_loop(
    st: OperatorState,
    namespace: str,
    name: str,
    logger: logging.Logger,
    wakeup: Wakeup,
    stop: asyncio.Future[None],
) -> None:
    """Reconcile on every wake-up (event, deadline, resync) until ``stop`` is done. A finished
    job sleeps until an event wakes it (a fixed invalid spec)."""
    timeout: float | None = st.resync_seconds
    while True:
        reason = await wakeup.wait(timeout, stop=stop)
        if stop.done():
            return
        if reason is None:
            reason = "resync" if timeout == st.resync_seconds else "deadline"
        try:
            # through the module: bench/operator_scale.py wraps it there
            outcome = await engine.reconcile_job(st, namespace, name, reason)
        except kopf.PermanentError:
            outcome = engine.FINISHED  # rejected: status and Event say why; a spec fix wakes us
        except Exception as err:  # the API server is away, a conflict: try again soon
            logger.warning(f"reconcile ({reason}) failed, retrying: {err!r}")
            outcome = engine.Outcome(requeue_after=min(st.resync_seconds, RETRY_SECONDS))
        if outcome.finished:
            timeout = None
        elif outcome.requeue_after is not None:
            timeout = min(max(outcome.requeue_after, 0.05), st.resync_seconds)
        else:
            timeout = st.resync_seconds
