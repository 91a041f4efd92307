"""Whisper-style audio encoder vs transformers' WhisperEncoder on the same weights; loading saved directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import WhisperConfig, WhisperModel
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from encoder_server.config import AUDIO_PRESETS, AudioConfig
from encoder_server.models.audio import AudioEncoder, load_audio, sinusoids

CPU = torch.device("cpu")
CFG = AudioConfig(num_mel_bins=80, d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96)


def _reference(cfg: AudioConfig, seed: int = 0) -> WhisperEncoder:
    hf_cfg = WhisperConfig(**cfg.to_hf_dict(), decoder_layers=1, decoder_attention_heads=4,
                           attn_implementation="eager")
    torch.manual_seed(seed)
    ref = WhisperEncoder(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every parameter matters
        for name, p in ref.named_parameters():
            if "layer_norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return ref


def _features(cfg: AudioConfig, batch: int) -> torch.Tensor:
    return torch.randn(batch, cfg.num_mel_bins, cfg.num_frames, generator=torch.Generator().manual_seed(1))


def test_parameter_names_equal_transformers() -> None:
    ours = AudioEncoder(CFG)
    ref = _reference(CFG)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("num_mels", [80, 128])
def test_forward_matches_whisper_encoder(num_mels: int) -> None:
    cfg = AudioConfig(num_mel_bins=num_mels, d_model=64, encoder_layers=2, encoder_attention_heads=4,
                      encoder_ffn_dim=96)
    ref = _reference(cfg)
    ours = AudioEncoder(cfg)
    ours.load_state_dict(ref.state_dict())
    ours.prepare_for_inference()
    x = _features(cfg, 3)
    with torch.no_grad():
        expected = ref(x).last_hidden_state
        got = ours(x)
    assert got.shape == (3, cfg.max_source_positions, cfg.d_model)
    assert (got - expected).abs().max().item() < 1e-5
    with torch.no_grad():  # a window's output does not depend on the rest of the batch
        assert (ours(x[1:2]) - got[1:2]).abs().max().item() < 1e-5


def test_rejects_wrong_feature_shape() -> None:
    model = AudioEncoder(CFG)
    with pytest.raises(ValueError, match="expects"):
        model(torch.zeros(1, CFG.num_mel_bins, 2999))
    with pytest.raises(ValueError, match="expects"):
        model(torch.zeros(1, 128, CFG.num_frames))


def test_load_encoder_save_pretrained(tmp_path: Path) -> None:
    ref = _reference(CFG)
    ref.save_pretrained(tmp_path)
    loaded = load_audio(str(tmp_path), CPU, torch.float32)
    assert loaded.cfg == CFG
    x = _features(CFG, 2)
    with torch.no_grad():
        assert (loaded.model(x) - ref(x).last_hidden_state).abs().max().item() < 1e-5
    assert load_audio(str(tmp_path), CPU, torch.float32).fingerprint == loaded.fingerprint


def test_load_full_whisper_model_encoder_prefix(tmp_path: Path) -> None:
    hf_cfg = WhisperConfig(**CFG.to_hf_dict(), decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=32,
                           max_target_positions=16, attn_implementation="eager")
    torch.manual_seed(3)
    full = WhisperModel(hf_cfg).eval()
    full.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        assert "encoder.conv1.weight" in f.keys() and any(k.startswith("decoder.") for k in f.keys())
    loaded = load_audio(str(tmp_path), CPU, torch.float32)
    x = _features(CFG, 1)
    with torch.no_grad():
        expected = full.encoder(x).last_hidden_state
        assert (loaded.model(x) - expected).abs().max().item() < 1e-5


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_audio(str(tmp_path / "missing"), CPU, torch.float32)
    ref = _reference(CFG)
    ref.save_pretrained(tmp_path)
    bigger = AudioConfig(d_model=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96)
    (tmp_path / "config.json").write_text(WhisperConfig(**bigger.to_hf_dict()).to_json_string())
    with pytest.raises(ValueError, match="do not match the config"):
        load_audio(str(tmp_path), CPU, torch.float32)


def test_tiny_preset_is_seeded_and_uses_sinusoids() -> None:
    a = load_audio("tiny", CPU, torch.float32)
    b = load_audio("tiny", CPU, torch.float32)
    assert a.fingerprint == b.fingerprint and a.cfg == AUDIO_PRESETS["tiny"]
    assert torch.equal(a.model.embed_positions.weight, sinusoids(1500, a.cfg.d_model))
    x = _features(a.cfg, 2)
    with torch.no_grad():
        out = a.model(x)
    assert out.shape == (2, 1500, a.cfg.d_model) and torch.isfinite(out).all()
    assert torch.equal(out, b.model(x))


def test_sinusoids_match_transformers() -> None:
    from transformers.models.whisper.modeling_whisper import sinusoids as hf_sinusoids

    assert torch.allclose(sinusoids(1500, 64), hf_sinusoids(1500, 64))


def test_config_presets() -> None:
    large = AUDIO_PRESETS["whisper-large-v3"]
    assert (large.num_mel_bins, large.d_model, large.encoder_layers, large.head_dim) == (128, 1280, 32, 64)
    assert AudioConfig.from_hf_dict(WhisperConfig(**large.to_hf_dict()).to_dict()) == large
    with pytest.raises(ValueError):
        AudioConfig(num_mel_bins=40)
