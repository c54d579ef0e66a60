"""`python -m deltafin [overrides]`: the command line is deltafin.cli."""

from deltafin.cli import main

if __name__ == "__main__":
    main()
