"""``python -m attnlib.bench <name> [options]``: ``--help`` lists the benchmarks (:mod:`attnlib.bench.cli`)."""
from attnlib.bench.cli import main

if __name__ == "__main__":
    main()
