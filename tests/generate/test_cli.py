"""`python -m titan_moe.serve.generate` loads a DCP checkpoint and prints prompt + completion;
the same checkpoint through the Python API gives the same greedy text."""

import torch
import torch.distributed.checkpoint as dcp

from titan_moe.data.tokenizer import TitanTokenizer, asset_path
from titan_moe.serve.generate import Generator, Sampling, load_model, main, model_args_from_toml


def _write_checkpoint(tmp_path, make_model, overrides):
    overrides = {**overrides, "vocab_size": 4096}
    config = tmp_path / "tiny.toml"
    lines = [f"{k} = {v}" for k, v in overrides.items()]
    config.write_text('[model]\nflavor = "debug"\n[titan_moe]\n' + "\n".join(lines) + "\n")
    model = make_model(seed=3, **overrides)
    step = tmp_path / "checkpoint" / "step-7"
    dcp.save(model.state_dict(), checkpoint_id=str(step))
    return config, model


def test_cli_prints_the_greedy_completion(tmp_path, make_model, tiny_overrides, capsys):
    config, model = _write_checkpoint(tmp_path, make_model, tiny_overrides)
    main(["--checkpoint", str(tmp_path), "--config", str(config), "--prompt", "def add(a, b):",
          "--max-new-tokens", "8", "--temperature", "0", "--device", "cpu"])
    printed = capsys.readouterr().out.strip()
    tokenizer = TitanTokenizer(asset_path(4096))
    expected = Generator(model, tokenizer).generate(["def add(a, b):"], 8, Sampling(0))[0]
    assert printed == "def add(a, b):" + tokenizer.decode(expected.tokens)


def test_loaded_weights_and_qb_biases_equal_the_saved_ones(tmp_path, make_model, tiny_overrides):
    config, model = _write_checkpoint(tmp_path, make_model, tiny_overrides)
    loaded = load_model(tmp_path / "checkpoint", model_args_from_toml(config), seed=99)
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values(),
                                 strict=True):
        assert torch.equal(want, got), name
