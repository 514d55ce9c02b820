"""Imported by the demo's fork server alone (first in ``prefork._PRELOAD``), to give it a name
in ``ps``: otherwise it shows as ``python -c from multiprocessing.forkserver import main; ...``
with every preloaded module spelled out, and nothing says whose it is."""

import os

from setproctitle import setproctitle

setproctitle(f"streamrl prefork server (for pid {os.getppid()})")
