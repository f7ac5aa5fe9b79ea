"""The step's runtime parts, each built from its section of the manifest: the model's parts and
precision, the optimizers (distributed, encoder ZeRO), the step runner with its encoder anchor,
the data plane, checkpoint sessions, metrics, progress and throughput; the training loop
(:mod:`omni_trainer.trainer`) composes them."""
