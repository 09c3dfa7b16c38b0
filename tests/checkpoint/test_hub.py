"""Checkpoints in the Hugging Face hub cache: snapshot folders whose files link into blobs/, and
repository ids resolved offline, by load_model, load_checkpoint, quantize and the commands."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from checkpoint_helpers import (
    TINY,
    hub_snapshot,
    llama_tensors,
    modelopt_folder,
    synthetic_gguf_metadata,
    write_checkpoint,
)

from fp8route.checkpoint.gguf_tokenizer import write_tokenizer
from fp8route.checkpoint.hub import hub_cache, resolve_model_path
from fp8route.checkpoint.load import load_checkpoint
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.cli import main
from fp8route.engine import load_model
from fp8route.errors import CheckpointError

IDS = torch.tensor([[1, 17, 200, 45, 3]])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache that HF_HUB_CACHE points at."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_snapshot_folder_loads_by_path(tmp_path, cache):
    reference = load_model(modelopt_folder(tmp_path / "a"), device="cpu", dtype=torch.float32)(IDS)
    snapshot = hub_snapshot(cache, "acme/tiny", modelopt_folder(tmp_path / "b"))
    assert (snapshot / "model.safetensors").is_symlink()
    torch.testing.assert_close(load_model(snapshot, device="cpu", dtype=torch.float32)(IDS), reference)
    assert load_checkpoint(snapshot, "cpu").dims is not None


def test_a_repository_id_resolves_to_its_snapshot(tmp_path, cache):
    snapshot = hub_snapshot(cache, "acme/tiny", modelopt_folder(tmp_path))
    assert resolve_model_path("acme/tiny") == snapshot
    assert load_checkpoint("acme/tiny", "cpu").path == snapshot
    assert load_model("acme/tiny", device="cpu")(IDS).shape == (1, 5, 256)
    commit = snapshot.name
    assert resolve_model_path(f"acme/tiny@{commit}") == snapshot
    (cache / "models--acme--tiny" / "refs" / "v1").write_text(commit)
    assert resolve_model_path("acme/tiny@v1") == snapshot


def test_hf_home_and_the_default_cache(tmp_path, monkeypatch):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    snapshot = hub_snapshot(tmp_path / "home" / "hub", "acme/tiny", modelopt_folder(tmp_path))
    assert resolve_model_path("acme/tiny") == snapshot
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hub_cache() == tmp_path / "user" / ".cache" / "huggingface" / "hub"


def test_without_refs_the_only_snapshot_is_used(tmp_path, cache):
    snapshot = hub_snapshot(cache, "acme/tiny", modelopt_folder(tmp_path))
    shutil.rmtree(cache / "models--acme--tiny" / "refs")
    assert resolve_model_path("acme/tiny") == snapshot
    (snapshot.parent / "feedbeef").mkdir()
    with pytest.raises(CheckpointError) as info:
        resolve_model_path("acme/tiny")
    assert str(info.value) == (
        f"acme/tiny: {cache / 'models--acme--tiny'} has no refs/main and 2 snapshots (snapshots: "
        f"{snapshot.name}, feedbeef): give acme/tiny@<commit>, or download it with `hf download acme/tiny` "
        "(or `huggingface-cli download acme/tiny`)"
    )


def test_a_local_folder_wins_over_a_repository_id(tmp_path, cache, monkeypatch):
    hub_snapshot(cache, "acme/tiny", modelopt_folder(tmp_path / "cached"))
    monkeypatch.chdir(tmp_path)
    local = modelopt_folder(tmp_path / "acme").rename(tmp_path / "acme" / "tiny")
    assert resolve_model_path("acme/tiny") == local.relative_to(tmp_path)


def test_an_uncached_repository_is_one_line(cache, capsys):
    message = (
        f"acme/missing is neither a local folder nor in the Hugging Face hub cache (no snapshot in "
        f"{cache / 'models--acme--missing'}): download it with `hf download acme/missing` (or `huggingface-cli "
        "download acme/missing`), point HF_HUB_CACHE at the cache that holds it, or give the checkpoint folder's path"
    )
    with pytest.raises(CheckpointError) as info:
        load_model("acme/missing", device="cpu")
    assert str(info.value) == message
    assert main(["inspect", "acme/missing"]) == 2
    assert capsys.readouterr().err == f"fp8route inspect: {message}\n"


def test_a_link_leaving_the_repository_is_refused(tmp_path, cache):
    snapshot = hub_snapshot(cache, "acme/tiny", modelopt_folder(tmp_path))
    other = hub_snapshot(cache, "other/model", modelopt_folder(tmp_path / "other"))
    link = snapshot / "model.safetensors"
    link.unlink()
    link.symlink_to(os.path.relpath((other / "model.safetensors").resolve(), snapshot))
    with pytest.raises(CheckpointError) as info:
        load_model("acme/tiny", device="cpu")
    target = (other / "model.safetensors").resolve()
    repository = (cache / "models--acme--tiny").resolve()
    assert str(info.value) == (
        f"shard model.safetensors in {snapshot} links to {target}, outside the checkpoint folder and outside "
        f"{repository / 'blobs'}, where its hub-cache repository keeps its files"
    )


def test_quantize_and_the_commands_take_a_repository_id(tmp_path, cache, capsys):
    metadata = synthetic_gguf_metadata()
    config = dict(TINY, vocab_size=len(metadata["tokenizer.ggml.tokens"]), eos_token_id=2)
    bf16 = write_checkpoint(tmp_path / "bf16", llama_tensors(config), config)
    write_tokenizer(metadata, bf16)
    hub_snapshot(cache, "acme/tiny-bf16", bf16)
    report = quantize_checkpoint("acme/tiny-bf16", tmp_path / "fp8", device="cpu")
    hub_snapshot(cache, "acme/tiny-fp8", report.dst)
    argv = ["generate", "acme/tiny-fp8", "--prompt", "the theme", "--max-new-tokens", "3", "--device", "cpu"]
    assert main(argv) == 0
    assert "TTFT" in capsys.readouterr().err
    assert main(["inspect", "acme/tiny-fp8", "--device", "cpu"]) == 0
    assert "checkpoint: " + str(cache / "models--acme--tiny-fp8" / "snapshots") in capsys.readouterr().out
    assert main(["quantize", "acme/tiny-bf16", str(tmp_path / "fp8-cli"), "--format", "modelopt", "--quiet"]) == 0
    assert (tmp_path / "fp8-cli" / "tokenizer.json").is_file() and not (
        tmp_path / "fp8-cli" / "tokenizer.json"
    ).is_symlink()
