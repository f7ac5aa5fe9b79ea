"""MegaScale-Omni trainer: encoder-LLM multiplexed training.

The package stands in floors, each importing only its own and the ones below: the torch-free
spec (the manifest and its config modules, ``costs``, ``storage``, the operator<->pod protocol;
what the operator and the planner import, so loading this package imports no torch); then
``data``, ``balance``, ``distributed`` and ``mcore``; ``models``, ``checkpoint`` and ``interop``;
``multiplex`` (the step's dataflow tables); ``components`` (the step's runtime parts); the
training loop and its launch (``trainer``, ``launch``, ``warm``); and on top the planner, the
pod's supervisor and the command line (``cli``). ``tests/unit/test_layers.py`` holds the order.
"""

from omni_trainer import megatron_imports

__version__ = "0.1.0"

megatron_imports.install()
