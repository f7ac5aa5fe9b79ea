"""Torch-free cost formulas: model FLOPs and MFU, FLOPs of a packed step, activation bytes."""
