"""Imported by the demo's fork server alone (first in ``prefork._PRELOAD``), to give it a name
in ``ps``: otherwise it shows as ``python -c from multiprocessing.forkserver import main; ...``
with every preloaded module spelled out, and nothing says whose it is.

It also turns the garbage collector off for the imports that follow: torch and transformers
leave ~350,000 objects that live as long as the process, and collecting among them while they
are created took ~0.4 s of the server's ~3.5 s (the time to the demo's first step). Each child
freezes what it inherits and turns the collector back on (``prefork._as_if_spawned``)."""

import gc
import os

from setproctitle import setproctitle

gc.disable()
setproctitle(f"streamrl prefork server (for pid {os.getppid()})")
