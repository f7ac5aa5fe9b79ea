"""Recovery: what went wrong with a running attempt, and whether to restart it (pure functions).

:mod:`~omni_operator.recovery.failures` classifies the current attempt's pods and Nodes into one
failure (or none); :mod:`~omni_operator.recovery.restarts` turns a failure into a decision: a
restart (in place, on new pods, on a hot spare) after a backoff, or failing the job, and which
nodes to quarantine. Both read pods and Nodes through :mod:`omni_operator.kube_objects`.
"""
