"""Encoder-LLM multiplexing: the dataflow tables (pure) that the encoder anchor
(:mod:`omni_trainer.components.anchor`) runs, the workload that feeds them, the reshard of
encoder outputs across stage 0's TP ranks, and the replay of an executed table.

Importing this package must not import torch: the planner and simulators use it on machines
without one. Each module is imported by its own path.
"""
