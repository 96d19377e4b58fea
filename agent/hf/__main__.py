"""``python -m agent.hf``: run one hf engine (see :mod:`agent.hf.cli`)."""

from agent.hf.cli import main

if __name__ == "__main__":
    main()
