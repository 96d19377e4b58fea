"""``python -m agent.sim``: run one sim engine (see :mod:`agent.sim.cli`)."""

from agent.sim.cli import main

if __name__ == "__main__":
    main()
