"""Parallel layout: pure dimension math here, process groups in ``omni_trainer.mcore``."""
