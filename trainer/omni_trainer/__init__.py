"""MegaScale-Omni trainer: encoder-LLM multiplexed training (no torch import at package load)."""

__version__ = "0.1.0"
