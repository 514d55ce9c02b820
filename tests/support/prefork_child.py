"""Run by tests/local/test_prefork.py as `python -m tests.support.prefork_child`: reports what a
forked role sees (its argv, an env var, whether torch came preloaded, its nice value, its
garbage collector), then exits, waits or touches a file."""

import gc
import os
import sys
import time

preloaded = "torch" in sys.modules  # before this module imports anything heavy
print(f"argv={sys.argv[1:]} env={os.environ.get('PREFORK_TEST')} torch={preloaded}", flush=True)
print(f"session_leader={os.getsid(0) == os.getpid()}", flush=True)
print(f"nice={os.getpriority(os.PRIO_PROCESS, 0)}", flush=True)
print(f"gc={gc.isenabled()} frozen={gc.get_freeze_count()}", flush=True)
if sys.argv[1:2] == ["touch"]:
    open(sys.argv[2], "w").close()
if sys.argv[1:2] == ["wait"]:
    time.sleep(120)
sys.exit(int(sys.argv[2]) if sys.argv[1:2] == ["exit"] else 0)
