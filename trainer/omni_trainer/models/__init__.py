"""The model: megatron-core's GPT for the LLM, the encoders and projectors, the omni model that
joins them, and the model-parallel layers they use (context, sequence and Ulysses parallelism,
packed attention, recompute)."""
