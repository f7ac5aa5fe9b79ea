"""megatron-core loads under the trainer without its import-time torch.compile wrappers (megatron's
own default is ``jit_fuser = torch.compile``), and nothing else the trainer imports loads inductor.
That the models build none of the fused paths is checked in ``trainer/test_llm.py``."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import omni_trainer.trainer  # everything a training process imports
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_dropout
assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
assert not hasattr(fused_bias_dropout.bias_dropout_add_fused_train, "_torchdynamo_orig_callable")
assert "torch._inductor.compile_fx" not in sys.modules, "something else imports inductor"
print("plain")
"""


def test_megatron_loads_without_compiling_wrappers_in_a_fresh_process() -> None:
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "plain", result.stderr[-3000:]
