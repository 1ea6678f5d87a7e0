"""Train the byte-level BPE tokenizer of a model flavor on a text corpus.

    python scripts/train_tokenizer.py --vocab-size 4096 --out titan_moe/assets/tokenizer_4096.json

Trains on the ``train`` split of ``--data`` (default: the stdlib corpus, prepared if missing),
so the ``val`` split stays unseen, then reports tokens per byte on ``val``. The vocab is the
special tokens, the 256 byte symbols and the learned merges, padded with reserved special tokens
to exactly ``--vocab-size``. The full flavor's 163,840-token vocab is trained the same way on the
cluster corpus (``--data CORPUS --vocab-size 163840``); it is not committed.
"""

import argparse
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_moe.data.corpus import iter_documents, list_data_files, resolve_split  # noqa: E402
from titan_moe.data.pystdlib import prepare_pystdlib  # noqa: E402
from titan_moe.data.tokenizer import SPECIAL_TOKENS, TitanTokenizer, reserved_token  # noqa: E402

DEFAULT_DATA = Path("data/pystdlib")


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    n_reserved = sum(t.startswith("<|reserved_") for t in SPECIAL_TOKENS)
    shortfall = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if shortfall > 0:
        tokenizer.add_special_tokens([reserved_token(n_reserved + i) for i in range(shortfall)])
    return tokenizer


def _documents(path: Path, split: str, text_field: str) -> Iterable[str]:
    files = list_data_files(resolve_split(path, split))
    return (text for _, text in iter_documents(files, text_field))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="tokenizer JSON to write")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="corpus file or folder")
    parser.add_argument("--text-field", default="text", help="jsonl / parquet text field")
    args = parser.parse_args()

    if args.data == DEFAULT_DATA:
        prepare_pystdlib(DEFAULT_DATA)
    train_docs = list(_documents(args.data, "train", args.text_field))
    train_bytes = sum(len(t.encode("utf-8")) for t in train_docs)
    begin = time.perf_counter()
    tokenizer = train_bpe(train_docs, args.vocab_size)
    seconds = time.perf_counter() - begin
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))

    loaded = TitanTokenizer(args.out)
    if loaded.get_vocab_size() != args.vocab_size:
        raise RuntimeError(f"vocab size {loaded.get_vocab_size()} != {args.vocab_size}")
    val = list(_documents(args.data, "val", args.text_field))
    val_bytes = sum(len(t.encode("utf-8")) for t in val)
    val_tokens = sum(len(loaded.encode(t, add_bos=False, add_eos=False)) for t in val)
    print(
        f"trained vocab {args.vocab_size} on {train_bytes / 2**20:.1f} MiB in {seconds:.1f}s; "
        f"val: {val_tokens / val_bytes:.3f} tokens/byte ({val_bytes / 2**20:.2f} MiB); "
        f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)"
    )


if __name__ == "__main__":
    main()
