"""`python -m titan_moe.plan`: the memory plan (`memory.py`)."""

import sys

from titan_moe.plan.memory import main

if __name__ == "__main__":
    sys.exit(main())
