"""MegaScale-Omni Kubernetes operator (kopf)."""
