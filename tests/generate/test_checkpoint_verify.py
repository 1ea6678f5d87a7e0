"""The generator loads only checkpoints that verify against their manifest and the model args.

Checkpoints are written as the trainer writes them (DCP, then checkpoint_verify.write_manifest);
the loaded weights are compared exactly with the saved model's, so loading the wrong step fails.
"""

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_moe.serve.generate import load_model
from titan_moe.train.checkpoint_verify import CheckpointError, ModelArgsMismatch, write_manifest


def save(model, folder, step):
    path = folder / f"step-{step}"
    dcp.save(model.state_dict(), checkpoint_id=str(path))
    write_manifest(path, model.args)
    return path


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def flip_a_byte(step):
    shards = (p for p in step.iterdir() if p.suffix == ".distcp")
    shard = max(shards, key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return shard


@pytest.fixture
def two_steps(tmp_path, make_model, tiny_overrides):
    old, new = make_model(seed=1, **tiny_overrides), make_model(seed=2, **tiny_overrides)
    save(old, tmp_path, 1)
    return old, new, save(new, tmp_path, 2)


def test_the_newest_verified_step_loads(tmp_path, two_steps):
    old, new, _ = two_steps
    assert same_weights(load_model(tmp_path, new.args, seed=9), new)


def test_a_damaged_newest_step_is_skipped_and_named(tmp_path, two_steps, capsys):
    old, new, step = two_steps
    shard = flip_a_byte(step)
    assert same_weights(load_model(tmp_path, new.args, seed=9), old)
    assert f"skipping checkpoint step-2: {shard} is damaged" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match=f"{shard} is damaged"):
        load_model(step, new.args)


def test_a_truncated_step_is_named(two_steps):
    _, new, step = two_steps
    shard = next(p for p in step.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=f"{shard} has .* bytes, the manifest"):
        load_model(step, new.args)


def test_other_model_args_name_the_field(two_steps):
    _, new, step = two_steps
    other = dataclasses.replace(new.args, n_layers=new.args.n_layers + 1)
    with pytest.raises(ModelArgsMismatch, match=f"n_layers: checkpoint {new.args.n_layers} "
                                                 f"vs config {other.n_layers}"):
        load_model(step, other)
