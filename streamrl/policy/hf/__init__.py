"""``hf``: a transformers model in this process (CPU or GPU), with micro-batching.

Three jobs, one module each:

- ``batching``: ``HFPolicy``. Requests from many episodes are queued and answered in
  micro-batches, one decode call at a time on the policy's one torch thread (``compute``),
  so the event loop keeps running.
- ``decode`` (with ``cache``, a KV cache that grows in place, and ``packed``, oneDNN layers):
  tokens from a batch of prompts. Every row is sampled with its request's own seed, and the
  log-probs of the sampling distribution are recorded (what the learner's importance weights
  need). Sampling runs through streamrl's KV-cache loop or through transformers' ``generate``.
- ``weights``: the served weights. A newer ``PolicyVersion`` on the run's ``policy`` stream is
  loaded between batches (full weights or a LoRA adapter); a version that fails to load keeps
  the old weights and shows as ``reload_error``.

Options (``PolicyConfig.options``): ``device`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:1``),
``dtype`` (``auto`` | ``float32`` | ``bfloat16`` | ``float16``), ``max_batch`` (32),
``reload_check_s`` (1.0), ``seed`` (0), ``trust_remote_code`` (false), ``lag_versions`` (0:
serve the newest version; N: the one announced N versions earlier, for off-policy experiments),
``decode`` (``loop``: streamrl's own KV-cache loop, which prefills each distinct prompt once,
so a group's samples share one prefill; ``generate``: transformers' ``generate``; both sample
through the same sampler and give the same tokens up to float noise), ``ignore_eos`` (false;
true: every row samples its whole ``max_new_tokens``, end-of-turn tokens included, so that a
benchmark compares engines doing the same work; never for training), ``packed_weights``
(true: the decode loop runs large linear layers through oneDNN on packed copies of their
weights, on the CPU; ``packed``).
"""

from streamrl.policy.hf.batching import HFPolicy

__all__ = ["HFPolicy"]
