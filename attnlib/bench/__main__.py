"""``python -m attnlib.bench <mha|kv-cache|memory> [options]``."""
from attnlib.bench.cli import main

if __name__ == "__main__":
    main()
