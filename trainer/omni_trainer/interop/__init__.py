"""Hugging Face interop at the edge: config translation, HF <-> megatron weight maps, streaming
import, export and greedy generation. Nothing here downloads from the Hub: a model is a local
directory or an ``s3://`` prefix."""
