"""Projector from an encoder's width to the LLM's hidden size (LLaVA-1.5 style two-layer MLP)."""

from __future__ import annotations

from torch import Tensor, nn


class Projector(nn.Module):
    """Linear, GELU, Linear: maps encoder tokens into the LLM embedding space, token by token."""

    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        """[tokens, in_dim] -> [tokens, out_dim]."""
        return self.fc2(self.act(self.fc1(x)))
