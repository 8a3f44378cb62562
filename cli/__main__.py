"""`python -m conveyor.cli`: the same as the `conveyor` console script."""

from conveyor.cli.entry import main

if __name__ == "__main__":
    main()
