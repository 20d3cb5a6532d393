"""``python -m omniscale ...``: the same command line as the ``omniscale`` console script."""

from omniscale.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
