"""`python -m titan_moe.plan`: the memory plan (`cli.py`)."""

import sys

from titan_moe.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
