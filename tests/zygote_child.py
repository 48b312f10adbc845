"""Forked by tests/test_zygote.py: `python -m tests.zygote_child CODE|sleep` says who it is
and what it was given, then exits with CODE or sleeps. Imported where ZYGOTE_SLOW_IMPORT is
set, it takes that many seconds."""

from __future__ import annotations

import os
import sys
import time

time.sleep(float(os.environ.get("ZYGOTE_SLOW_IMPORT", "0")))

if __name__ == "__main__":
    print(f"child pid={os.getpid()} sid={os.getsid(0)} value={os.environ.get('ZYGOTE_VALUE')} "
          f"argv={sys.argv[1:]}", flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(600)
    sys.exit(int(sys.argv[1]))
