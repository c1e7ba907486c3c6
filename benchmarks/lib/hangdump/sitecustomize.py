"""Put on PYTHONPATH with HANG_DUMP_AFTER_S=N: every process started then prints all its threads' stacks
to stderr every N seconds (a peer engine that goes silent at start shows where it waits)."""

import faulthandler
import os
import sys

_after = os.environ.get("HANG_DUMP_AFTER_S")
if _after:
    faulthandler.dump_traceback_later(float(_after), repeat=True, file=sys.stderr)
