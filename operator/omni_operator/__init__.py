"""MegaScale-Omni Kubernetes operator (kopf).

Pure planners (spec, placement, rendering, failure classification and restart decisions) under a
pure reconcile (``reconcile``: observed objects in, actions out), under thin kopf handlers
(``handlers``: the handlers, the per-job loop, the observe/apply engine); ``sandbox`` emulates a
cluster for ``omni sandbox`` and the tests. ``tests/unit/test_layers.py`` holds the floors.
"""
