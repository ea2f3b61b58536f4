"""Checkpoints at stable paths (afd_devcluster.checkpoints.cached_vllm_checkpoint): written once
under the project's cache, then found again, with the bytes the plain writer gives."""

from __future__ import annotations

import filecmp

from afd_devcluster.checkpoints import cached_vllm_checkpoint, write_vllm_checkpoint


def test_a_cached_checkpoint_is_written_once_at_a_path_its_arguments_name(tmp_path, monkeypatch):
    monkeypatch.setenv("AFD_CACHE_DIR", str(tmp_path / "cache"))
    first = cached_vllm_checkpoint("qwen3_moe", seed=4)
    assert first.parent == tmp_path / "cache" / "checkpoints"
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_vllm_checkpoint("qwen3_moe", seed=4) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    # Nothing half-written is left beside it.
    assert [p.name for p in first.parent.iterdir()] == [first.name]
    plain = write_vllm_checkpoint(tmp_path / "plain", "qwen3_moe", seed=4)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert filecmp.cmp(first / name, plain / name, shallow=False), name
    others = {cached_vllm_checkpoint("qwen3_moe", seed=5), cached_vllm_checkpoint("qwen2_moe", seed=4),
              cached_vllm_checkpoint("qwen3_moe", seed=4, layers=2)}
    assert first not in others and len(others) == 3
