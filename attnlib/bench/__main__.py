"""``python -m attnlib.bench <mha|kv-cache|memory|train> [options]``."""
from attnlib.bench.cli import main

if __name__ == "__main__":
    main()
