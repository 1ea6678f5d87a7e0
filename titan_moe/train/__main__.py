"""`python -m titan_moe.train` (and torchrun's `-m titan_moe.train`): train from a TOML."""

from titan_moe.train.trainer import main

if __name__ == "__main__":
    main()
