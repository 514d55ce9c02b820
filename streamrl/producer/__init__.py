"""Producers push tasks (``produce``: from an environment's generator or a JSONL file, read
by ``rows``); admission control decides when (``admission``, built from ``readings``,
``drop_budget``, ``memory_budget``, ``holds`` and ``state``)."""

from streamrl.producer.admission import LearnerAdmission, admission_batch, admission_limit
from streamrl.producer.holds import DROP_BUDGET, MEMORY_BUDGET, NO_LEARNER, WINDOW_FULL, Hold
from streamrl.producer.produce import BATCH, Admission, Producer, ProduceResult, training_seed

__all__ = [
    "BATCH",
    "DROP_BUDGET",
    "MEMORY_BUDGET",
    "NO_LEARNER",
    "WINDOW_FULL",
    "Admission",
    "Hold",
    "LearnerAdmission",
    "ProduceResult",
    "Producer",
    "admission_batch",
    "admission_limit",
    "training_seed",
]
