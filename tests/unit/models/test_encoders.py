"""Encoder modules: shapes at dynamic resolution, batch-composition invariance, gradients."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from omni_trainer.models.encoders import layers
from omni_trainer.models.encoders.audio import AudioEncoder
from omni_trainer.models.encoders.config import AudioEncoderConfig, VisionEncoderConfig
from omni_trainer.models.encoders.layers import (
    TokenMixer,
    Varlen,
    sincos_2d,
    varlen_attention,
)
from omni_trainer.models.encoders.projector import Projector
from omni_trainer.models.encoders.vision import VisionEncoder

VIT = VisionEncoderConfig(preset="vit-tiny")
CONFORMER = AudioEncoderConfig(preset="conformer-tiny", conv_kernel_size=5)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _vit() -> VisionEncoder:
    torch.manual_seed(0)
    return VisionEncoder(VIT).eval()


def _conformer() -> AudioEncoder:
    torch.manual_seed(0)
    return AudioEncoder(CONFORMER).eval()


def dense_block_diagonal(q, k, v, seqs: Varlen) -> torch.Tensor:
    """Independent reference: one SDPA over the whole pack with a dense same-sample mask."""
    seg = torch.repeat_interleave(torch.arange(len(seqs.lengths)), torch.tensor(seqs.lengths))
    mask = seg[:, None] == seg[None, :]  # full attention restricted to each sample
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    ).transpose(0, 1)


def test_varlen_attention_is_block_diagonal(gen: torch.Generator) -> None:
    seqs = Varlen.of([3, 5, 1])
    q, k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(3))
    out = varlen_attention(q, k, v, seqs)
    torch.testing.assert_close(out, dense_block_diagonal(q, k, v, seqs), rtol=1e-5, atol=1e-5)


def test_boundaries_come_from_host_lengths_and_reach_a_device_once() -> None:
    seqs = Varlen.of([3, 5, 1])
    assert (seqs.total, seqs.max_seqlen) == (9, 5)
    cu = seqs.cu_seqlens(torch.device("cpu"))
    assert cu.tolist() == [0, 3, 8, 9] and cu.dtype == torch.int32  # flash-attn's format
    assert seqs.cu_seqlens("cpu") is cu  # copied once, reused by every layer


@pytest.fixture
def gpu_kernel_lookup(monkeypatch):
    """A machine that claims CUDA, with the kernel lookup redone (and forgotten afterwards)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    layers.gpu_varlen_kernel.cache_clear()
    yield
    layers.gpu_varlen_kernel.cache_clear()


@pytest.mark.parametrize("installed", ["flash_attn", "torch"])
def test_the_gpu_kernel_gets_the_packed_boundaries(
    installed: str, monkeypatch, gpu_kernel_lookup, gen: torch.Generator
) -> None:
    """flash-attn's kernel where installed, else PyTorch's: either gets the whole pack with
    int32 cu_seqlens and the longest sample, in its own argument order, and its answer is the
    reference's (fakes stand in for the CUDA kernels and compute it)."""
    import types

    from torch.nn.attention import varlen

    seen = {}

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, *, causal=False, **kw):
        causal = causal or kw.get("window_size") == (-1, 0)  # flash-attn's / torch's keyword
        seen.update(cu=cu_q.tolist(), same=cu_q is cu_k, max=(max_q, max_k), causal=causal)
        seen.update(dropout=dropout_p)
        lengths = torch.diff(cu_q).tolist()  # the test's fake may read back; the real one not
        return dense_block_diagonal(q, k, v, Varlen.of(lengths))

    if installed == "flash_attn":
        monkeypatch.setitem(
            sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake)
        )
    else:
        monkeypatch.setitem(sys.modules, "flash_attn", None)  # import fails: not installed

        def torch_fake(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return fake(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window_size)

        monkeypatch.setattr(varlen, "varlen_attn", torch_fake)
    kernel = layers.gpu_varlen_kernel()
    assert installed in kernel.__name__
    seqs = Varlen.of([4, 2, 6])
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), seqs)
    assert seen == {}  # CPU tensors: the kernel cannot serve them, SDPA does
    monkeypatch.setattr(layers, "kernel_serves", lambda q: True)
    out = varlen_attention(q, k, v, seqs)
    expected = {"cu": [0, 4, 6, 12], "same": True, "max": (6, 6), "causal": False, "dropout": 0.0}
    assert seen == expected
    torch.testing.assert_close(out, dense_block_diagonal(q, k, v, seqs), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_no_gpu_kernel_without_cuda() -> None:
    assert layers.gpu_varlen_kernel() is None


def test_sincos_2d_depends_on_grid_position() -> None:
    pos = sincos_2d(2, 3, 8)
    assert pos.shape == (6, 8)
    assert torch.unique(pos, dim=0).shape[0] == 6  # every patch position is distinct
    # row-major: a 2x3 grid's first row is the 1x3 grid; column codes do not depend on the height
    torch.testing.assert_close(pos[:3], sincos_2d(1, 3, 8))


def test_patch_embedding_equals_conv2d(gen: torch.Generator) -> None:
    enc = _vit()
    image = torch.randn(3, 28, 42, generator=gen)
    conv = enc.patch_embed(image[None])[0]  # [hidden, 2, 3]
    linear = enc.patchify(image) @ enc.patch_embed.weight.flatten(1).T + enc.patch_embed.bias
    torch.testing.assert_close(linear, conv.flatten(1).T, rtol=1e-5, atol=1e-5)


def test_vision_dynamic_resolution_and_batch_invariance(gen: torch.Generator) -> None:
    enc = _vit()
    images = [
        torch.randn(3, 28, 56, generator=gen),  # 2x4 patches
        torch.randn(3, 70, 14, generator=gen),  # 5x1 patches
        torch.randn(3, 42, 42, generator=gen),  # 3x3 patches
    ]
    with torch.no_grad():
        together = enc(images)
        alone = torch.cat([enc([img]) for img in images])
        reordered = enc(images[::-1])
    assert together.shape == (8 + 5 + 9, VIT.hidden_size)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reordered[:9], together[-9:], rtol=1e-5, atol=1e-5)


def test_vision_rejects_bad_images() -> None:
    enc = _vit()
    with pytest.raises(ValueError, match="patch_size"):
        enc([torch.zeros(3, 30, 28)])
    with pytest.raises(ValueError, match="channels"):
        enc([torch.zeros(1, 28, 28)])


def test_audio_shapes_and_batch_invariance(gen: torch.Generator) -> None:
    enc = _conformer()
    clips = [torch.randn(n, CONFORMER.n_mels, generator=gen) for n in (40, 12, 64)]
    with torch.no_grad():
        together = enc(clips)
        alone = torch.cat([enc([c]) for c in clips])
    assert together.shape == (10 + 3 + 16, CONFORMER.hidden_size)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)


def test_audio_rejects_bad_lengths() -> None:
    with pytest.raises(ValueError, match="subsampling"):
        _conformer()([torch.zeros(10, CONFORMER.n_mels)])


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_params_match_config_and_all_get_gradients(which: str, gen: torch.Generator) -> None:
    if which == "vision":
        enc, cfg = _vit().train(), VIT
        inputs = [torch.randn(3, 28, 42, generator=gen), torch.randn(3, 14, 14, generator=gen)]
    else:
        enc, cfg = _conformer().train(), CONFORMER
        inputs = [torch.randn(n, CONFORMER.n_mels, generator=gen) for n in (16, 8)]
    assert sum(p.numel() for p in enc.parameters()) == cfg.params()
    proj = Projector(cfg.hidden_size, 48)
    out = proj(enc(inputs))
    assert out.shape[1] == 48
    out.square().mean().backward()
    params = [*enc.named_parameters(), *proj.named_parameters()]
    no_grad = [n for n, p in params if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


def test_init_follows_global_seed() -> None:
    a, b = _vit(), _vit()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name


class RecordingMixer(TokenMixer):
    """The default mixer, counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def attention(self, q, k, v, seqs):
        self.calls.append("attention")
        return super().attention(q, k, v, seqs)

    def gather_sequence(self, x, seqs):
        self.calls.append("gather")
        return super().gather_sequence(x, seqs)

    def scatter_sequence(self, x_full):
        self.calls.append("scatter")
        return super().scatter_sequence(x_full)


def _inputs(which: str, gen: torch.Generator) -> list[torch.Tensor]:
    if which == "vision":
        return [torch.randn(3, 28, 42, generator=gen), torch.randn(3, 14, 70, generator=gen)]
    return [torch.randn(n, CONFORMER.n_mels, generator=gen) for n in (24, 36)]


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_embed_then_encode_tokens_is_forward(which: str, gen: torch.Generator) -> None:
    enc = _vit() if which == "vision" else _conformer()
    inputs = _inputs(which, gen)
    with torch.no_grad():
        x, lengths = enc.embed(inputs)
        staged = enc.encode_tokens(x, Varlen.of(lengths))
        whole = enc(inputs)
    assert lengths == ([6, 5] if which == "vision" else [6, 9])
    assert x.shape == (sum(lengths), enc.cfg.hidden_size)
    torch.testing.assert_close(staged, whole, rtol=0, atol=0)


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_every_token_mixing_op_goes_through_the_shared_mixer(
    which: str, gen: torch.Generator
) -> None:
    mixer = RecordingMixer()
    torch.manual_seed(0)
    if which == "vision":
        enc, ref = VisionEncoder(VIT, mixer=mixer).eval(), _vit()
    else:
        enc, ref = AudioEncoder(CONFORMER, mixer=mixer).eval(), _conformer()
    assert enc.mixer is mixer
    assert all(m.mixer is mixer for m in enc.modules() if hasattr(m, "mixer"))
    inputs = _inputs(which, gen)
    with torch.no_grad():
        torch.testing.assert_close(enc(inputs), ref(inputs), rtol=0, atol=0)
    per_block = ["attention"] if which == "vision" else ["attention", "gather", "scatter"]
    assert mixer.calls == per_block * enc.cfg.num_layers


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_encoders_equal_a_dense_block_diagonal_reference(which: str, gen: torch.Generator) -> None:
    """The default core (per-sample SDPA from host lengths) against one dense masked SDPA."""
    torch.manual_seed(0)
    cls, cfg = (VisionEncoder, VIT) if which == "vision" else (AudioEncoder, CONFORMER)
    reference = cls(cfg, mixer=TokenMixer(core=dense_block_diagonal)).eval()
    inputs = _inputs(which, gen)
    with torch.no_grad():
        torch.testing.assert_close(
            _vit()(inputs) if which == "vision" else _conformer()(inputs),
            reference(inputs),
            rtol=1e-5,
            atol=1e-5,
        )


@pytest.mark.parametrize("which", ["vision", "audio"])
def test_the_layer_loop_never_reads_the_device(which: str) -> None:
    """On the meta device any host read (``.item()``, ``.tolist()``, ``int()``, a data-dependent
    shape) raises: the blocks run forward and backward there, so they never sync the host."""
    enc = (_vit() if which == "vision" else _conformer()).train().to("meta")
    seqs = Varlen.of([6, 5, 9])
    x = torch.empty(seqs.total, enc.cfg.hidden_size, device="meta", requires_grad=True)
    out = enc.encode_tokens(x, seqs)
    assert out.shape == x.shape and out.device.type == "meta"
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
