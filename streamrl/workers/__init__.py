"""Worker roles (rollout, verify) as rq lease jobs, and the rq worker class that runs them."""

from streamrl.workers.lease_worker import LeaseWorker

__all__ = ["LeaseWorker"]
