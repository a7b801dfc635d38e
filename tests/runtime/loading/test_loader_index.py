"""A sharded checkpoint's index names files inside its folder, or the load is refused.

Pins: shards named in `model.safetensors.index.json` load from the checkpoint folder (subfolders included,
and the Hugging Face cache's snapshot links into its `blobs` folder); a name that is absolute, climbs out
with `..`, or is a link resolving outside the folder is a `ModelLoadError` naming the index and the shard,
before any file outside is opened.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ferrox_batch.runtime.errors import ModelLoadError
from ferrox_batch.runtime.loading.loader import load_model


def sharded(source: Path, folder: Path, shard: str, weights_at: Path | None = None) -> Path:
    """`source` copied to `folder` with its weights listed in an index under the name `shard`; the weights file
    itself moved to `weights_at` (default: where `shard` points inside the folder)."""
    shutil.copytree(source, folder)
    names = load_file(str(folder / "model.safetensors")).keys()
    target = weights_at or folder / shard
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(folder / "model.safetensors", target)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    return folder


def test_shards_inside_the_folder_load(tiny_llama_dir, tmp_path):
    folder = sharded(tiny_llama_dir, tmp_path / "ckpt", "weights/model-00001-of-00001.safetensors")
    assert load_model(folder, device="cpu", dtype="float32").config.architecture == "LlamaForCausalLM"


def test_the_hugging_face_cache_layout_loads(tiny_llama_dir, tmp_path):
    repo = tmp_path / "models--org--tiny"
    snapshot = sharded(tiny_llama_dir, repo / "snapshots" / "abc123", "model-00001-of-00001.safetensors",
                       weights_at=repo / "blobs" / "deadbeef")
    os.symlink("../../blobs/deadbeef", snapshot / "model-00001-of-00001.safetensors")
    assert load_model(snapshot, device="cpu", dtype="float32").config.architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("kind", ["parent", "absolute", "link"])
def test_a_shard_outside_the_folder_is_refused(tiny_llama_dir, tmp_path, kind):
    outside = tmp_path / "elsewhere" / "stolen.safetensors"
    name = {"parent": "../elsewhere/stolen.safetensors", "absolute": str(outside), "link": "shard.safetensors"}[kind]
    folder = sharded(tiny_llama_dir, tmp_path / "ckpt", name, weights_at=outside)
    if kind == "link":
        os.symlink(outside, folder / "shard.safetensors")
    with pytest.raises(ModelLoadError, match="outside the checkpoint folder") as refused:
        load_model(folder, device="cpu", dtype="float32")
    assert "model.safetensors.index.json" in str(refused.value) and name in str(refused.value)
