"""The only package that touches megatron-core's global ``parallel_state`` (STYLE.md rule 6)."""
