"""FLOPs and MFU accounting: hand-computed cases, public orders of magnitude, peak detection."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omni_trainer.costs.flops import (
    DEVICE_PEAK_FLOPS,
    DEVICE_PEAKS,
    attention_flops,
    detect_peak_flops,
    matmul_flops,
    measure_peak_flops,
    mfu,
    training_flops,
    transformer_flops,
    transformer_matmul_params,
)

TINY = {"num_layers": 1, "hidden_size": 4, "ffn_hidden_size": 8, "num_heads": 2}


def test_one_layer_by_hand() -> None:
    # matmul params: q,k,v 3*4*4 = 48, o 4*4 = 16, MLP 2*4*8 = 64 -> 128
    # linear FLOPs: 2 * 128 * 3 tokens = 768
    # attention: (QK^T + AV) 2 * 2 * s^2 * h = 4 * 9 * 4 = 144
    assert transformer_flops(**TINY, seq_lengths=[3]) == 768 + 144


def test_variants_by_hand() -> None:
    # LM head: + 2 * (4 * 10) * 3 = 240
    assert transformer_flops(**TINY, vocab_size=10, seq_lengths=[3]) == 912 + 240
    # causal counts half the square: 144 / 2 = 72
    assert transformer_flops(**TINY, seq_lengths=[3], causal=True) == 768 + 72
    # GQA with 1 K/V group: k,v 2 * 4 * (1 * 2) = 16 instead of 32 -> 112 params
    assert transformer_matmul_params(**TINY, num_query_groups=1) == 112
    # gated MLP: 3 * 4 * 8 = 96 instead of 64 -> 160 params
    assert transformer_matmul_params(**TINY, gated_mlp=True) == 160
    # two sequences never attend to each other: 4 * h * (3^2 + 5^2) = 4 * 4 * 34 = 544
    assert transformer_flops(**TINY, seq_lengths=[3, 5]) == 2 * 128 * 8 + 544


def test_llama_7b_matches_6nt() -> None:
    """LLaMA-7B (Touvron et al. 2023: 6.7B params): training FLOPs ~ 6 N T plus attention."""
    shape = {
        "num_layers": 32,
        "hidden_size": 4096,
        "ffn_hidden_size": 11008,
        "num_heads": 32,
        "gated_mlp": True,
        "vocab_size": 32000,
    }
    seqs = [2048] * 4
    tokens = sum(seqs)
    forward = transformer_flops(**shape, seq_lengths=seqs)
    attention = attention_flops(num_layers=32, num_heads=32, head_dim=128, seq_lengths=seqs)
    assert attention == 32 * 4 * 4096 * 2048**2 * 4
    # matmul params exclude the 131M input embedding: 6.61B of LLaMA's 6.74B.
    assert training_flops(forward - attention) == pytest.approx(6 * 6.74e9 * tokens, rel=0.03)
    # at 2K context attention adds ~8% over 6NT (4 * s * h * L vs 2 * N per token)
    assert 0.05 < attention / (forward - attention) < 0.10


def test_mfu_and_training() -> None:
    assert training_flops(10.0) == 30.0
    assert mfu(378e12, 989e12) == pytest.approx(0.382, abs=1e-3)
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 0.0)


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "H200 SXM"),
        ("NVIDIA H800", "H800 SXM"),
        ("NVIDIA H800 PCIe", "H800 PCIe"),
        ("NVIDIA H20", "H20"),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
        ("NVIDIA A100 80GB PCIe", "A100 80GB"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA L40S", "L40S"),
    ],
)
def test_detect_peak_from_datasheet(name: str, key: str) -> None:
    assert detect_peak_flops(name) == (DEVICE_PEAKS[key]["bf16"], f"datasheet:{key} bf16")
    fp32 = detect_peak_flops(name, dtype="fp32")
    assert fp32 == (DEVICE_PEAKS[key]["fp32"], f"datasheet:{key} fp32")
    assert fp32[0] < DEVICE_PEAKS[key]["bf16"]


def test_detect_peak_override_and_unknown() -> None:
    assert detect_peak_flops("NVIDIA H100 80GB HBM3", override=1e12) == (1e12, "override")
    assert detect_peak_flops(None, override=2e11) == (2e11, "override")
    assert detect_peak_flops(None) is None
    assert detect_peak_flops("Tesla T4") is None
    assert DEVICE_PEAK_FLOPS["H100 SXM"] == DEVICE_PEAK_FLOPS["H200 SXM"] == 989e12
    assert DEVICE_PEAK_FLOPS["A100 80GB"] == DEVICE_PEAK_FLOPS["A100 40GB"] == 312e12


def test_unknown_gpu_warns_and_measures(monkeypatch) -> None:
    import torch

    from omni_trainer.components import throughput

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA X9000")
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda device, dtype: 5e14)
    with pytest.warns(UserWarning, match="no datasheet peak FLOPs for 'NVIDIA X9000'"):
        peak, source = throughput.resolve_peak_flops(
            torch.device("cuda", 0), dtype=torch.bfloat16, world_size=8, override_per_device=None
        )
    assert (peak, source) == (4e15, "measured bf16 matmul x 8 devices")


def test_measure_peak_keeps_fastest_call() -> None:
    times = iter([0.0, 2.0, 10.0, 11.0, 20.0, 24.0])  # calls of 2 s, 1 s, 4 s
    calls = []
    peak = measure_peak_flops(
        lambda: calls.append(1),
        flops_per_call=matmul_flops(10, 10, 10),
        iters=3,
        clock=lambda: next(times),
    )
    assert peak == 2000.0  # 2 * 10^3 FLOPs in 1 s
    assert len(calls) == 4  # 1 warmup + 3 timed


def test_flops_module_is_torch_free() -> None:
    code = (
        "import sys, omni_trainer.costs.flops, omni_trainer.models.encoders.config;"
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def megatron_num_floating_point_operations(
    *,
    batch_size: int,
    seq_length: int,
    num_layers: int,
    hidden_size: int,
    ffn_hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    kv_channels: int,
    swiglu: bool,
    padded_vocab_size: int,
) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (``megatron/training/training.py``,
    NVIDIA/Megatron-LM commit 001b00c2734d8f0fad096fe48a382fedf755d321, ``transformer_flops()``),
    transcribed for a dense GPT: no MoE, no MTP, no MLA, no attention output gate. An independent
    reference: it shares no code with ``costs.flops``."""
    forward_backward_expansion_factor = 3
    fma_expansion_factor = 2
    ffn_expansion_factor = 3 if swiglu else 2
    query_projection_size = kv_channels * num_attention_heads
    key_projection_size = kv_channels * num_query_groups
    value_projection_size = kv_channels * num_query_groups
    standard_self_attn_term = (
        forward_backward_expansion_factor
        * fma_expansion_factor
        * (
            hidden_size * (query_projection_size + key_projection_size + value_projection_size)
            + query_projection_size * seq_length / 2 * 2  # causal mask; QK^T and (QK^T)V
            + query_projection_size * hidden_size
        )
    )
    return (
        batch_size
        * seq_length
        * (
            forward_backward_expansion_factor
            * fma_expansion_factor
            * hidden_size
            * (ffn_hidden_size * ffn_expansion_factor)
            * num_layers
            + standard_self_attn_term * num_layers
            + forward_backward_expansion_factor
            * fma_expansion_factor
            * hidden_size
            * padded_vocab_size
        )
    )


@pytest.mark.parametrize(
    ("shape", "seq_length"),
    [
        # LLaMA-3-8B: GQA (8 K/V groups) + SwiGLU, 128K vocabulary.
        ({"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
          "num_query_groups": 8, "ffn_hidden_size": 14336, "gated_mlp": True,
          "vocab_size": 128256}, 8192),
        # Plain GPT: multi-head attention, GELU MLP.
        ({"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_query_groups": 4,
          "ffn_hidden_size": 1024, "gated_mlp": False, "vocab_size": 512}, 300),
    ],
)  # fmt: skip
def test_llm_training_flops_equal_megatron_lm(shape: dict, seq_length: int) -> None:
    """The LLM's FLOPs (what the summary, metrics, planner and calibration count) equal
    Megatron-LM's on the same config: causal attention counts half of each square."""
    from omni_trainer.costs.flops import MFU_CONVENTION
    from omni_trainer.models.config import LLMConfig

    llm = LLMConfig(**shape, normalization="RMSNorm")
    batch = 3
    ours = training_flops(llm.flops([seq_length] * batch))
    reference = megatron_num_floating_point_operations(
        batch_size=batch,
        seq_length=seq_length,
        num_layers=llm.num_layers,
        hidden_size=llm.hidden_size,
        ffn_hidden_size=llm.ffn_hidden_size,
        num_attention_heads=llm.num_attention_heads,
        num_query_groups=llm.num_query_groups,
        kv_channels=llm.head_dim,
        swiglu=bool(llm.gated_mlp),
        padded_vocab_size=llm.vocab_size,
    )
    assert ours == pytest.approx(reference, rel=1e-12)
    assert MFU_CONVENTION == "megatron-lm"


def test_cpu_matmul_rate_stops_at_a_size_that_times_well(monkeypatch) -> None:
    """bf16 on a CPU without bf16 units runs at ~1 GFLOP/s: the measurement grows the matmul from
    the smallest size and stops at the first one timed long enough, not at a minute-long 2048."""
    import torch

    from omni_trainer.components import throughput

    sizes: list[int] = []
    randn = torch.randn

    def spy(*shape, **kw):
        sizes.append(shape[0])
        return randn(*shape, **kw)

    monkeypatch.setattr(torch, "randn", spy)
    rate = throughput.measure_matmul_flops(torch.device("cpu"), torch.bfloat16)
    assert rate > 0
    tried = sizes[::2]
    assert sizes[1::2] == tried and tried == list(throughput.MATMUL_SIZES[: len(tried)]), sizes


def test_cpu_peak_is_measured_once_per_machine_and_kept(tmp_path) -> None:
    import torch

    from omni_trainer.components.throughput import cpu_matmul_flops

    path, calls = tmp_path / "cache" / "peak-flops.json", []

    def measure(device, dtype) -> float:
        calls.append(dtype)
        return 1e11 * len(calls)

    assert cpu_matmul_flops(torch.float32, measure=measure, path=path) == (1e11, False)
    assert cpu_matmul_flops(torch.float32, measure=measure, path=path) == (1e11, True)
    assert cpu_matmul_flops(torch.bfloat16, measure=measure, path=path) == (2e11, False)
    assert len(json.loads(path.read_text())) == 2  # both dtypes kept
    assert calls == [torch.float32, torch.bfloat16]
    path.write_text("{not json")  # a damaged cache is measured around and rewritten
    assert cpu_matmul_flops(torch.float32, measure=measure, path=path) == (3e11, False)
    assert cpu_matmul_flops(torch.float32, measure=measure, path=path) == (3e11, True)


def test_cpu_peak_without_a_writable_cache_is_measured_each_time(tmp_path) -> None:
    import torch

    from omni_trainer.components.throughput import cpu_matmul_flops

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache's folder would be: not writable
    path = blocker / "peak-flops.json"
    assert cpu_matmul_flops(torch.float32, measure=lambda d, t: 5e10, path=path) == (5e10, False)
    assert cpu_matmul_flops(torch.float32, measure=lambda d, t: 6e10, path=path) == (6e10, False)


def test_cpu_peak_source_says_cached(monkeypatch, tmp_path) -> None:
    import torch

    from omni_trainer.components import throughput

    monkeypatch.setenv("OMNI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda device, dtype: 4e10)
    cpu = torch.device("cpu")
    kw = {"dtype": torch.float32, "world_size": 2, "override_per_device": None}
    assert throughput.resolve_peak_flops(cpu, **kw) == (4e10, "measured fp32 matmul, whole CPU")
    monkeypatch.setattr(throughput, "measure_matmul_flops", lambda device, dtype: 1.0)
    assert throughput.resolve_peak_flops(cpu, **kw) == (
        4e10,
        "measured fp32 matmul, whole CPU (cached)",
    )
    assert (tmp_path / "peak-flops.json").exists()
