"""Byte-level BPE tokenizer behind torchtitan's ``BaseTokenizer`` interface.

A document becomes ``[bos] + bpe(utf8_bytes(text)) + [eos]``; byte-level BPE is lossless, so
``decode(encode(text)) == text`` for every string. The vocabulary is ``SPECIAL_TOKENS`` (ids
0..15), the 256 byte symbols, the learned merges and, where BPE training stopped short,
``<|reserved_N|>`` padding so that the size equals the model flavor's vocab exactly.

Committed files (``titan_moe/assets/``): ``tokenizer_4096.json`` (debug flavor) and
``tokenizer_32768.json`` (proxy flavor), both trained on the CPython stdlib corpus with
``scripts/train_tokenizer.py``. The full flavor (vocab 163,840) is trained the same way on the
cluster corpus: ``python scripts/train_tokenizer.py --data CORPUS --vocab-size 163840 --out ...``.
"""

from pathlib import Path

from tokenizers import Tokenizer
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
IMAGE_TOKEN = "<|image|>"
IMAGE_START_TOKEN = "<|image_start|>"
IMAGE_END_TOKEN = "<|image_end|>"
SPECIAL_TOKENS = [
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    IMAGE_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_END_TOKEN,
    *(f"<|reserved_{i}|>" for i in range(10)),
]

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
FLAVOR_VOCAB_SIZE = {"debug": 4096, "proxy": 32768, "full": 163840}


def reserved_token(index: int) -> str:
    """Name of the ``index``-th reserved special token (also used to pad the vocab)."""
    return f"<|reserved_{index}|>"


def asset_path(vocab_size: int) -> Path:
    """Where the committed tokenizer JSON for ``vocab_size`` lives."""
    return ASSETS_DIR / f"tokenizer_{vocab_size}.json"


def _missing_tokenizer_error(path: Path, vocab_size: int | None = None) -> FileNotFoundError:
    size = vocab_size if vocab_size is not None else "VOCAB_SIZE"
    return FileNotFoundError(
        f"tokenizer file not found: {path}. Create it with: "
        f"python scripts/train_tokenizer.py --vocab-size {size} --out {path}"
    )


class TitanTokenizer(BaseTokenizer):
    """A HuggingFace ``tokenizers`` JSON file with bos/eos/pad ids.

    Special-token strings that occur inside text are encoded as plain text, so training data
    can never inject control tokens; insert special tokens by id (``token_to_id``).
    """

    def __init__(self, path: str | Path):
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise _missing_tokenizer_error(self.path)
        self.tokenizer = Tokenizer.from_file(str(self.path))
        self.tokenizer.encode_special_tokens = True
        self.bos_id = self._required_id(BOS_TOKEN)
        self.eos_id = self._required_id(EOS_TOKEN)
        self.pad_id = self._required_id(PAD_TOKEN)
        # An image is `<|image_start|>` + one `<|image|>` per merged patch + `<|image_end|>`.
        self.image_id = self.token_to_id(IMAGE_TOKEN)
        self.image_start_id = self.token_to_id(IMAGE_START_TOKEN)
        self.image_end_id = self.token_to_id(IMAGE_END_TOKEN)

    def _required_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.path} has no {token}; retrain it with train_tokenizer.py")
        return token_id

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)


def tokenizer_path_for(job_config: JobConfig) -> Path:
    """The tokenizer file a job uses.

    Order: ``model.tokenizer_path`` (a JSON file or a folder holding ``tokenizer.json``), then
    ``model.hf_assets_path/tokenizer.json`` if present, then the committed asset whose vocab
    matches ``model.flavor`` (a name starting with debug / proxy / full).
    """
    explicit = job_config.model.tokenizer_path
    if explicit:
        path = Path(explicit)
        return path / "tokenizer.json" if path.is_dir() else path
    hf_assets = Path(job_config.model.hf_assets_path) / "tokenizer.json"
    if hf_assets.is_file():
        return hf_assets
    flavor = job_config.model.flavor
    for prefix, vocab_size in FLAVOR_VOCAB_SIZE.items():
        if flavor.startswith(prefix):
            path = asset_path(vocab_size)
            if not path.is_file():
                raise _missing_tokenizer_error(path, vocab_size)
            return path
    raise FileNotFoundError(
        f"no tokenizer for model.flavor={flavor!r}: set model.tokenizer_path to a tokenizer JSON "
        f"(known flavors: {sorted(FLAVOR_VOCAB_SIZE)})"
    )


def build_tokenizer(job_config: JobConfig) -> TitanTokenizer:
    """TrainSpec ``build_tokenizer_fn``."""
    return TitanTokenizer(tokenizer_path_for(job_config))
