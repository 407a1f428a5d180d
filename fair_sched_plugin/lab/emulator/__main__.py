"""``python -m fair_sched_plugin.lab.emulator --port N ...``: serve the emulator in this process."""

import sys

from .server import main

if __name__ == "__main__":
    sys.exit(main())
