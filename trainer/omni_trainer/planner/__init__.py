"""The planner: predict a multimodal training job before spending GPUs.

On the cost model (:mod:`omni_trainer.costs.devices`, :mod:`omni_trainer.costs.step_costs`), a
discrete-event simulator that executes the trainer's own schedule objects (``simulate``), the
paper's workloads (``workloads``) and a configuration search (``tune``). Pure Python, no torch.
"""

from omni_trainer.costs.devices import (
    A100,
    GH200,
    H100,
    H200,
    PROFILES,
    DeviceProfile,
    cpu_profile,
)
from omni_trainer.costs.step_costs import Layout
from omni_trainer.planner.simulate import Prediction, predict, predict_disaggregated, run_schedule
from omni_trainer.planner.tune import Candidate, tune
from omni_trainer.planner.workloads import Workload, paper_workloads

__all__ = [
    "A100",
    "GH200",
    "H100",
    "H200",
    "PROFILES",
    "Candidate",
    "DeviceProfile",
    "Layout",
    "Prediction",
    "Workload",
    "cpu_profile",
    "paper_workloads",
    "predict",
    "predict_disaggregated",
    "run_schedule",
    "tune",
]
