"""The metric families of one ``streamrl metrics`` scrape: every name the exporter can emit,
with its type, labels and help text, in one place (the Grafana dashboard's test reads them
here)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)


class Families:
    """The metric families of one scrape, with their help text."""

    def __init__(self) -> None:
        g, c = GaugeMetricFamily, CounterMetricFamily
        run, stage = ["run"], ["run", "stream", "group"]
        self.stream_length = g(
            "streamrl_stream_length", "Entries in a run's stream.", labels=["run", "stream"]
        )
        self.lag = g(
            "streamrl_consumer_group_lag", "Entries not yet delivered to the group.", labels=stage
        )
        self.pending = g(
            "streamrl_consumer_group_pending", "Entries delivered, not yet acked.", labels=stage
        )
        self.consumers = g(
            "streamrl_consumer_group_consumers", "Consumers in the group.", labels=stage
        )
        self.trajectories = c(
            "streamrl_trajectories", "Trajectories finished by rollout workers.", labels=run
        )
        self.scored = c("streamrl_samples_scored", "Samples scored with a reward.", labels=run)
        self.groups_completed = c(
            "streamrl_groups_completed", "Groups assembled and written to `groups`.", labels=run
        )
        self.groups_dropped = c(
            "streamrl_groups_dropped",
            "Groups never trained on, by reason: failed_sample (a sample was dead-lettered) or "
            "the learner's stale, zero_variance, no_tokens, invalid.",
            labels=["run", "reason"],
        )
        self.duplicates = c(
            "streamrl_duplicate_samples_ignored", "Re-sent samples ignored.", labels=run
        )
        self.dead_letters = c(
            "streamrl_dead_letters",
            "Entries that left their stage for good, by stage and reason class (folded from "
            "the dead-letter stream since the exporter started).",
            labels=["run", "stage", "reason"],
        )
        self.reward = HistogramMetricFamily(
            "streamrl_reward",
            "Rewards on the scored feed, by environment (folded since the exporter started).",
            labels=["run", "env"],
        )
        self.score_failures = c(
            "streamrl_score_failures",
            "Samples on the scored feed with no reward (a failure, never a 0).",
            labels=["run", "env"],
        )
        self.masked_samples = c(
            "streamrl_masked_samples",
            "Samples whose score the environment masked (NeMo Gym's mask_sample), by its "
            "failure_kind: dead letters, never rewards.",
            labels=["run", "env", "kind"],
        )
        env = ["run", "env"]
        self.env_dead_letters = c(
            "streamrl_env_dead_letters",
            "Dead letters by the environment of their sample (folded since the exporter "
            "started; `unknown`: a dataset row, or bytes that did not decode).",
            labels=env,
        )
        self.env_weight = g(
            "streamrl_env_weight", "An environment's weight in the run's mixture.", labels=env
        )
        self.env_paused = g(
            "streamrl_env_paused",
            "1 while a tripwire (or an operator) holds an environment's prompts back.",
            labels=env,
        )
        self.env_tripped = g(
            "streamrl_env_tripwire_fired", "1 once a reward-hacking tripwire fired.", labels=env
        )
        self.env_reward = g(
            "streamrl_env_reward_mean",
            "Mean reward of an environment's last groups the learner read.",
            labels=env,
        )
        self.env_solved = g(
            "streamrl_env_solved_rate", "Share of an environment's last groups solved.", labels=env
        )
        self.env_no_signal = g(
            "streamrl_env_no_signal_rate",
            "Share of an environment's last groups with no signal.",
            labels=env,
        )
        self.env_rate = g(
            "streamrl_env_samples_per_second",
            "Samples of an environment the learner read per second, over its last groups.",
            labels=env,
        )
        self.env_staleness = g(
            "streamrl_env_staleness_mean",
            "Mean policy versions behind, over an environment's last groups.",
            labels=env,
        )
        # the run's LLM judge (`judge:stats`, streamrl.verifiers.judge)
        self.judge_samples = c(
            "streamrl_judge_samples", "Samples the LLM judge graded.", labels=run
        )
        self.judge_calls = c("streamrl_judge_calls", "Calls made to the LLM judge.", labels=run)
        self.judge_cached = c(
            "streamrl_judge_cache_hits", "Judge grades read from its cache.", labels=run
        )
        self.judge_failures = c(
            "streamrl_judge_failures",
            "Samples the judge gave up on after its retries (a failure, never a 0).",
            labels=run,
        )
        self.judge_throttled = c(
            "streamrl_judge_throttled",
            "Judge answers 429 or 503: the run's pool held off the endpoint.",
            labels=run,
        )
        self.policy_version = g(
            "streamrl_policy_version", "Newest policy version announced.", labels=run
        )
        self.policy_age = g(
            "streamrl_policy_version_age_seconds",
            "Seconds since the newest policy version was announced.",
            labels=run,
        )
        self.faulted = g("streamrl_run_faulted", "1 while the run's fault key is set.", labels=run)
        self.behind = g(
            "streamrl_rollout_workers_behind_policy",
            "Rollout workers serving a version beyond max_staleness behind.",
            labels=run,
        )
        self.reload_failing = g(
            "streamrl_rollout_workers_reload_failing",
            "Rollout workers whose last policy reload failed.",
            labels=run,
        )
        self.policy_in_flight = g(
            "streamrl_policy_requests_in_flight",
            "Rollout workers' requests on each policy server, at their last heartbeat.",
            labels=["run", "server"],
        )
        self.policy_waiting = g(
            "streamrl_policy_requests_waiting",
            "Requests waiting for a slot of a policy server (max_inflight_per_server).",
            labels=["run", "server"],
        )
        self.learner_status = g(
            "streamrl_learner_status",
            "1 for the learner's current status.",
            labels=["run", "status"],
        )
        self.learner_step = g("streamrl_learner_step", "Optimizer steps taken.", labels=run)
        self.learner_policy_version = g(
            "streamrl_learner_policy_version", "Policy version the learner is at.", labels=run
        )
        self.learner_loss = g("streamrl_learner_loss", "Loss of the last step.", labels=run)
        self.learner_reward_mean = g(
            "streamrl_learner_reward_mean", "Mean reward of the last step's batch.", labels=run
        )
        self.learner_entropy = g(
            "streamrl_learner_entropy_nats", "Mean token entropy of the last batch.", labels=run
        )
        self.learner_grad_norm = g(
            "streamrl_learner_grad_norm", "Gradient norm of the last step.", labels=run
        )
        self.learner_lr = g(
            "streamrl_learner_learning_rate", "Learning rate of the last step.", labels=run
        )
        # training-inference mismatch (streamrl.learner.mismatch): the last step that had
        # rows sampled by the learner's own weights; absent until one had
        self.learner_mismatch_abs = g(
            "streamrl_learner_mismatch_abs",
            "Mean |log p_learner - log p_sampler| over on-policy tokens (last measured step).",
            labels=run,
        )
        self.learner_mismatch_kl = g(
            "streamrl_learner_mismatch_kl",
            "k3 estimate of KL(sampler || learner) over on-policy tokens (last measured step).",
            labels=run,
        )
        self.learner_mismatch_tokens = g(
            "streamrl_learner_mismatch_tokens",
            "Tokens the last measured training-inference mismatch was taken over.",
            labels=run,
        )
        self.learner_waiting = g(
            "streamrl_learner_waiting_groups", "Accepted groups waiting for a batch.", labels=run
        )
        self.learner_solved_rate = g(
            "streamrl_learner_solved_rate",
            "Share of the last solved_window groups that every sample solved (top reward).",
            labels=run,
        )
        self.learner_no_signal_rate = g(
            "streamrl_learner_no_signal_rate",
            "Share of the last solved_window groups that all scored alike below the top.",
            labels=run,
        )
        self.learner_no_signal = g(
            "streamrl_learner_no_signal",
            "1 while the groups have had no signal for no_signal_warn_groups in a row.",
            labels=run,
        )
        self.learner_max_in_flight = g(
            "streamrl_learner_max_in_flight_samples",
            "Admission limit the producer obeys.",
            labels=run,
        )
        self.learner_consumed = c(
            "streamrl_learner_groups_consumed", "Groups the learner read.", labels=run
        )
        self.learner_applied = c(
            "streamrl_learner_groups_applied",
            "Groups trained on, by how many policy versions behind the learner they were.",
            labels=["run", "staleness"],
        )
        self.learner_solved = c(
            "streamrl_learner_groups_solved",
            "Zero-variance groups every sample solved (of the zero_variance drops).",
            labels=run,
        )
        self.learner_no_signal_groups = c(
            "streamrl_learner_groups_no_signal",
            "Zero-variance groups all alike below the top reward (of the zero_variance drops).",
            labels=run,
        )
        self.learner_samples = c(
            "streamrl_learner_samples_consumed", "Samples in the groups read.", labels=run
        )
        self.learner_tokens = c(
            "streamrl_learner_tokens_trained", "Completion tokens trained on.", labels=run
        )
        self.learner_is_tokens = c(
            "streamrl_learner_importance_weight_tokens",
            "Completion tokens with a behaviour log-prob (an importance weight).",
            labels=run,
        )
        self.learner_is_clipped = c(
            "streamrl_learner_importance_weight_clipped_tokens",
            "Of those, tokens whose importance weight was truncated or masked.",
            labels=run,
        )
        self.checkpoint_time = g(
            "streamrl_learner_last_checkpoint_timestamp_seconds",
            "Unix time of the learner's last checkpoint.",
            labels=run,
        )
        self.checkpoint_age = g(
            "streamrl_learner_last_checkpoint_age_seconds",
            "Seconds since the learner's last checkpoint.",
            labels=run,
        )
        self.learner_updated_age = g(
            "streamrl_learner_last_report_age_seconds",
            "Seconds since the learner last wrote its progress.",
            labels=run,
        )
        self.producer_waiting = g(
            "streamrl_producer_waiting", "1 while admission control holds the producer.", labels=run
        )
        self.producer_in_flight = g(
            "streamrl_producer_in_flight_samples", "Samples in flight past the learner.", labels=run
        )
        q = ["queue"]
        self.rq_workers = g("streamrl_rq_workers", "Live rq workers on the queue.", labels=q)
        self.rq_busy = g("streamrl_rq_workers_busy", "Of those, workers holding a lease.", labels=q)
        self.rq_registered = g(
            "streamrl_rq_workers_registered", "Workers rq lists, live or dead.", labels=q
        )
        self.rq_queued = g("streamrl_rq_queued_leases", "Lease jobs waiting.", labels=q)
        self.rq_failed = g(
            "streamrl_rq_failed_leases", "Lease jobs in rq's failed registry.", labels=q
        )
        self.redis_used = g("streamrl_redis_memory_used_bytes", "INFO used_memory.")
        self.redis_max = g("streamrl_redis_memory_max_bytes", "INFO maxmemory (0: none).")

    def all(self) -> Iterator[Metric]:
        for value in vars(self).values():
            if isinstance(value, Metric) and value.samples:
                yield value
