"""megatron-core loaded without its import-time ``torch.compile`` wrappers.

``megatron.core.jit`` sets ``jit_fuser = torch.compile``, and each megatron module that decorates
a function with it (the fused bias-activation and bias-dropout paths, gated attention output, MoE
routing, L2Norm) then imports torch's inductor while it loads: about 3 s of CPU in every process
that imports megatron. None of those functions runs here: the LLM config turns megatron's fusions
off (``bias_dropout_fusion``, ``bias_activation_fusion`` and ``masked_softmax_fusion`` are False in
:mod:`omni_trainer.models.llm`), and the others belong to features the trainer does not build. So
the jit fuser is disabled the moment ``megatron.core.jit`` has loaded, with megatron's own
``disable_jit_fuser``, and the decorated functions stay the plain functions they are.

Torch-free (it only watches an import): :mod:`omni_trainer` installs it when it loads, so it is in
place before any module of the package imports megatron.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

JIT_MODULE = "megatron.core.jit"


class _DisableJitFuserOnLoad(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as the path finder would and disables its jit fuser right
    after the module body ran, before any other megatron module reads ``jit_fuser``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_body = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_body(module)
            module.disable_jit_fuser()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader
        return spec


def install() -> None:
    """Disable megatron's jit fuser as ``megatron.core.jit`` loads (at once if it already has)."""
    if JIT_MODULE in sys.modules:
        sys.modules[JIT_MODULE].disable_jit_fuser()
    elif not any(isinstance(f, _DisableJitFuserOnLoad) for f in sys.meta_path):
        sys.meta_path.insert(0, _DisableJitFuserOnLoad())
