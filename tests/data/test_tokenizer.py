"""The committed byte-level BPE tokenizers: exact round trip, exact vocab sizes, loading rules."""

import importlib.util
import sysconfig
from pathlib import Path

import pytest
from torchtitan.config import JobConfig

from titan_moe.data.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    TitanTokenizer,
    asset_path,
    build_tokenizer,
)

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# shlex and email/message contain non-ASCII characters
STDLIB_SAMPLES = ["json/decoder.py", "textwrap.py", "shlex.py", "email/message.py"]
ODD_TEXT = "tabs\tand\r\nCRLF  \u00e9\u4e2d\u6587 \U0001f600 \u200b <|eos|><|image|> \x00 end"


@pytest.fixture(scope="module", params=[4096, 32768])
def committed(request) -> tuple[int, TitanTokenizer]:
    return request.param, TitanTokenizer(asset_path(request.param))


def test_vocab_size_is_exactly_the_flavor_vocab(committed):
    vocab_size, tokenizer = committed
    assert tokenizer.get_vocab_size() == vocab_size
    ids = [tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IMAGE_TOKEN)]
    assert ids == [0, 1, 2, 3]
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (0, 1, 2)


def test_round_trip_on_stdlib_source(committed):
    _, tokenizer = committed
    texts = [(STDLIB / rel).read_text(encoding="utf-8") for rel in STDLIB_SAMPLES]
    for text in [*texts, ODD_TEXT]:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
        assert tokenizer.eos_id not in ids[1:-1]  # special-token strings in text stay text
        assert tokenizer.decode(ids) == text
        assert max(ids) < tokenizer.get_vocab_size()


def test_missing_tokenizer_names_path_and_command(tmp_path):
    path = tmp_path / "tokenizer_4096.json"
    with pytest.raises(FileNotFoundError, match="train_tokenizer.py") as err:
        TitanTokenizer(path)
    assert str(path) in str(err.value)


def test_build_tokenizer_picks_the_flavor_asset(tmp_path):
    config = JobConfig()
    config.model.hf_assets_path = str(tmp_path)
    config.model.flavor = "debug"
    assert build_tokenizer(config).get_vocab_size() == 4096
    config.model.flavor = "full"
    with pytest.raises(FileNotFoundError, match=r"--vocab-size 163840"):
        build_tokenizer(config)
    config.model.tokenizer_path = str(asset_path(4096))
    assert build_tokenizer(config).path == asset_path(4096)


def test_training_pads_the_vocab_to_exactly_the_requested_size(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tokenizer", SCRIPTS / "train_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    texts = ["def f(x):\n    return x + 1\n"] * 20
    tokenizer = script.train_bpe(texts, vocab_size=400)  # far more than this corpus can merge
    path = tmp_path / "tiny.json"
    tokenizer.save(str(path))
    loaded = TitanTokenizer(path)
    assert loaded.get_vocab_size() == 400
    assert loaded.token_to_id("<|reserved_10|>") is not None
    assert loaded.decode(loaded.encode(texts[0] + ODD_TEXT)) == texts[0] + ODD_TEXT
