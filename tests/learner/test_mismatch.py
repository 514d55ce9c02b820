"""Sampler and learner agree, turn by turn: multi-turn ``counter`` episodes sampled by the
``hf`` backend, then laid out and scored by the learner.

The model is the tiny Llama with three more words: ``<tool_call>``, ``</tool_call>`` and
``<tool>``, and a chat template that renders tool calls and tool outputs (``<tool> …``). The
random model emits ``<tool_call>`` often, the turn parses as a (malformed) tool call, the
environment answers with an error output, and the episode goes on: real multi-turn episodes
whose later prompts hold earlier turns, tool outputs and template boundaries, every model
turn sampled by the ``hf`` sampler.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from streamrl.config import PolicyConfig, RolloutConfig
from streamrl.envs.registry import make_env
from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.mismatch import measure, weights_version
from streamrl.learner.train import batch_loss
from streamrl.models.tiny import SYMBOLS, build_tokenizer
from streamrl.policy.base import Policy, PolicyRequest
from streamrl.policy.hf import HFPolicy
from streamrl.schema import SCHEMA_VERSION, Group, ModelTurn, Sample, Score, Task
from streamrl.schema import encode as schema_encode
from streamrl.workers.episode import new_session, run_episode
from tests.support import TEST_DEVICE

_VOCAB = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>", "copy", ":", *SYMBOLS,
          "<tool_call>", "</tool_call>", "<tool>", "error:", "unknown", "tool"]  # fmt: skip
_TEMPLATE = (
    "{{ '<bos>' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ ' <user> ' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ ' <assistant> ' + m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}"
    "{{ ' <tool_call> ' + (c['function']['arguments'] | string) + ' </tool_call>' }}"
    "{% endfor %}{{ ' <eos>' }}"
    "{% elif m['role'] == 'tool' %}{{ ' <tool> ' + m['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <assistant>' }}{% endif %}"
)
GROUPS, GROUP_SIZE = 3, 4


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(_VOCAB, _TEMPLATE)
    config = LlamaConfig(vocab_size=len(_VOCAB), hidden_size=64, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tool-tiny")
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


class _Recorder(Policy):
    """The hf policy, and a record of every turn it handed out: what the sampler produced,
    kept apart from the trajectory the learner is given."""

    name = "recorder"

    def __init__(self, inner: HFPolicy) -> None:
        self.inner = inner
        self.turns: dict[tuple[str, int], tuple[list[int], list[int], list[float]]] = {}

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        turn = await self.inner.respond(request)
        key = (request.task.task_id, request.turn)
        self.turns[key] = (list(turn.prompt_token_ids), list(turn.token_ids), list(turn.logprobs))
        return turn


def _episodes(model_dir) -> tuple[list[Group], _Recorder, HFPolicy]:
    env = make_env("counter", steps=2)
    config = PolicyConfig(
        backend="hf",
        model=str(model_dir),
        temperature=1.0,
        max_new_tokens=10,
        options={"device": TEST_DEVICE, "dtype": "float32"},
    )
    policy = _Recorder(HFPolicy(config, env))
    rng, groups = random.Random(0), []

    async def play(task: Task):
        return await run_episode(env, policy, task, new_session(env, task), None,
                                 RolloutConfig(max_turns=4))  # fmt: skip

    for g in range(GROUPS):
        prompt = env.generate(rng, g)
        tasks = [Task(task_id=f"p{g}:{k}", prompt_id=f"p{g}", k=k, group_size=GROUP_SIZE,
                      env="counter", input=prompt.input, data=prompt.data)
                 for k in range(GROUP_SIZE)]  # fmt: skip
        trajs = asyncio.run(_gather([play(t) for t in tasks]))
        samples = [Sample(trajectory=t, score=Score(task_id=t.task_id, prompt_id=t.prompt_id,
                                                    k=k, reward=float(k % 2)))
                   for k, t in enumerate(trajs)]  # fmt: skip
        groups.append(Group(SCHEMA_VERSION, f"p{g}", GROUP_SIZE, 0.5, 0.5, samples))
    return groups, policy, policy.inner


async def _gather(coros):
    return await asyncio.gather(*coros)


@pytest.fixture(scope="module")
def episodes(tool_model):
    return _episodes(tool_model)


def _rows(batch) -> list[list[int]]:
    return [
        ids[mask.bool()].tolist()
        for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True)
    ]


def test_episodes_are_multi_turn_with_tool_outputs(episodes):
    groups, recorder, _ = episodes
    trajs = [s.trajectory for g in groups for s in g.samples]
    multi = [t for t in trajs if len(t.turns) >= 2]
    assert len(multi) >= 3 and max(len(t.turns) for t in trajs) >= 3, [len(t.turns) for t in trajs]
    tool = _VOCAB.index("<tool>")
    # a later turn's prompt holds the tool output of an earlier one, as the sampler saw it
    assert any(tool in t.turns[-1].prompt_token_ids for t in multi)
    assert len(recorder.turns) == sum(len(t.turns) for t in trajs)


def test_later_turns_continue_the_sampled_tokens_never_a_retokenization(episodes):
    """A later turn's prompt starts with the previous turn's prompt and the tokens the model
    sampled, id for id (plus the eos a turn cut at ``max_new_tokens`` lacks): the model's own
    words are never decoded and tokenized again. Re-rendering the conversation instead broke
    this for 2 of 8 turn pairs of these episodes (a random model's text does not round-trip)."""
    _, recorder, policy = episodes
    eos = policy.tokenizer.eos_token_id
    pairs = 0
    for (task_id, turn), (prompt, _, _) in recorder.turns.items():
        if turn == 0:
            continue
        before, sampled, _ = recorder.turns[(task_id, turn - 1)]
        head = before + sampled + ([] if sampled[-1] == eos else [eos])
        assert prompt[: len(head)] == head, f"{task_id} turn {turn} re-tokenized an earlier turn"
        assert len(prompt) > len(head)  # and the tool output follows
        pairs += 1
    assert pairs >= 5
    assert policy.full_renders == 0


def test_each_tool_output_reaches_the_next_turns_prompt_as_rendered(episodes):
    """The boundary between turns: the next prompt is the earlier turns' tokens, then
    ``<tool> {output}`` in the template's tokens, then ``<assistant>``."""
    groups, _, policy = episodes
    tok, seen = policy.tokenizer, 0
    for s in (s for g in groups for s in g.samples):
        outputs = [i.output for i in s.trajectory.items if hasattr(i, "output")]
        for turn, output in zip(s.trajectory.turns[1:], outputs, strict=False):
            rendered = tok(" <tool> " + output + " <assistant>", add_special_tokens=False)
            want, have = rendered["input_ids"], turn.prompt_token_ids
            assert have[-len(want) :] == want
            seen += 1
    assert seen >= 3


def test_the_learner_trains_on_exactly_the_sampled_tokens_of_every_turn(episodes):
    """Each episode is one learner row, its last turn's prompt and completion token for token
    what the sampler had and drew (earlier turns, tool outputs and template inside it), and
    the loss falls on exactly the tokens the sampler drew in every turn, each with the
    log-prob the sampler recorded for it: never on a tool output or a template token."""
    groups, recorder, policy = episodes
    batch = make_batch(groups, policy.tokenizer.pad_token_id, "group", weights_version=0)
    rows = _rows(batch)
    samples = [s for g in groups for s in g.samples]
    assert len(rows) == len(samples)  # one row per episode, however many turns
    for i, (row, s) in enumerate(zip(rows, samples, strict=True)):
        turns = [recorder.turns[(s.trajectory.task_id, t.index)] for t in s.trajectory.turns]
        prompt, tokens, _ = turns[-1]
        assert row == prompt + tokens, f"row {i} is not what the sampler produced"
        on = batch.mask[i].bool()
        assert batch.targets[i][on].tolist() == [tok for _, toks, _ in turns for tok in toks]
        drawn = [lp for _, _, lps in turns for lp in lps]
        assert batch.behaviour_logps[i][on].tolist() == pytest.approx(drawn, abs=0)
    assert sum(len(s.trajectory.turns) for s in samples) > len(samples)  # chains were merged


def test_the_mismatch_on_policy_is_float_noise(episodes, tool_model):
    """The learner's forward (right padding, shared prompts) against the sampler's KV-cache
    decode with left padding, both float32 on CPU, same weights: they differ only by float
    summation order, 1e-7 to 1e-6 per token (measured: 8e-8 mean over ~170 tokens). Bound:
    mean |Δ log p| < 1e-5 and k3 < 1e-10 (k3 ≈ Δ²/2); one token off by 0.01 already breaks
    it, and a retokenized turn or a wrong temperature gives differences of order 0.1-1."""
    from transformers import AutoModelForCausalLM

    groups, _, policy = episodes
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()
    cfg = LearnerConfig(model=str(tool_model), temperature=1.0)
    batch = make_batch(groups, policy.tokenizer.pad_token_id, "group", weights_version=0)
    with torch.no_grad():
        measured = batch_loss(model, batch, cfg, backward=False).mismatch
    means = measured.means()
    print("mismatch on multi-turn hf episodes:", means)
    assert measured.tokens == batch.num_tokens > 0
    assert means["mismatch_abs"] < 1e-5
    assert 0 <= means["mismatch_kl"] < 1e-10

    # rows of another version are drift, not mismatch: nothing is measured, not a 0
    stale = make_batch(groups, policy.tokenizer.pad_token_id, "group", weights_version=1)
    assert batch_loss(model, stale, cfg, backward=False).mismatch.means() == {}
    unknown = make_batch(groups, policy.tokenizer.pad_token_id, "group", weights_version=None)
    assert batch_loss(model, unknown, cfg, backward=False).mismatch.means() == {}


def test_one_perturbed_behaviour_logprob_shows_in_the_mismatch():
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    behaviour = torch.tensor([[math.nan, -2.0, -0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    on = torch.tensor([True])
    assert measure(logps, behaviour, mask, on).means()["mismatch_abs"] == 0.0
    behaviour[0, 2] = -0.7  # the learner finds the token likelier: Δ = 0.2
    got = measure(logps, behaviour, mask, on).means()
    assert got["mismatch_tokens"] == 2
    assert got["mismatch_abs"] == pytest.approx(0.1)
    assert got["mismatch_kl"] == pytest.approx((math.exp(0.2) - 1 - 0.2) / 2)
    assert measure(logps, behaviour, mask, torch.tensor([False])).means() == {}


def test_weights_version_is_known_only_right_after_a_publish():
    assert weights_version(0, 0, 1) == 0
    assert weights_version(6, 3, 2) == 3
    assert weights_version(7, 3, 2) is None


def test_the_learner_reports_the_mismatch_in_its_hash_status_and_metrics(
    episodes, tool_model, redis_url, tmp_path
):
    """The whole learner on the hf episodes: step 0 trains on rows version 0 sampled, with
    the weights version 0 published, so it measures; the hash, ``streamrl status`` and the
    exporter carry it. With ``sync_every = 2`` step 1's weights are no published version:
    it measures nothing, and the hash keeps step 0's figure, named as such."""
    import io
    import threading

    import redis
    from rich.console import Console

    from streamrl.bus.keys import Keys
    from streamrl.bus.streams import ensure_groups
    from streamrl.learner.loop import run_learner
    from streamrl.ops.metrics import _Collector
    from streamrl.ops.status import collect
    from streamrl.ops.views import status_table

    groups, _, _ = episodes
    r, keys = redis.Redis.from_url(redis_url), Keys("mm")
    ensure_groups(r, keys)
    for g in [*groups, groups[0]]:  # 4 groups: two steps of two, all sampled by version 0
        r.xadd(keys.groups, {"id": g.prompt_id, "p": schema_encode(g)})
    cfg = LearnerConfig(
        model=str(tool_model), output_dir=str(tmp_path / "out"), torch_threads=1,
        batch_groups=2, sync_every=2, checkpoint_every=2, max_staleness=1, lr=1e-3,
        block_ms=100,
    )  # fmt: skip
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(state=run_learner(redis_url, "mm", cfg, exit_when_idle=0.5))
    )
    t.start()
    t.join(120)
    assert box["state"].step == 2

    h = {k.decode(): v.decode() for k, v in r.hgetall(keys.learner).items()}
    assert int(h["mismatch_step"]) == 1  # the state's step after step 0, the measured one
    assert float(h["mismatch_abs"]) < 1e-5 and int(h["mismatch_tokens"]) > 0
    info = collect(r, "mm")
    assert info["learner"]["mismatch_abs"] == pytest.approx(float(h["mismatch_abs"]))
    out = io.StringIO()
    Console(file=out, width=200).print(status_table(info))
    assert "train/infer mismatch" in out.getvalue()
    metrics = {f.name: f for f in _Collector(r, lambda: ["mm"]).collect()}
    for name in ("mismatch_abs", "mismatch_kl", "mismatch_tokens"):
        family = metrics[f"streamrl_learner_{name}"]
        assert family.samples[0].value == pytest.approx(float(h[name])), name


def test_only_rows_of_the_current_version_are_measured(episodes, tool_model):
    """A batch mixing versions: the rows an older version sampled count as drift, and are
    left out token for token."""
    import msgspec
    from transformers import AutoModelForCausalLM

    groups, _, policy = episodes
    older = [
        msgspec.structs.replace(
            s,
            trajectory=msgspec.structs.replace(
                s.trajectory,
                turns=[msgspec.structs.replace(t, policy_version=1) for t in s.trajectory.turns],
            ),
        )
        for s in groups[0].samples
    ]
    mixed = [msgspec.structs.replace(groups[0], samples=older), *groups[1:]]
    model = AutoModelForCausalLM.from_pretrained(tool_model, dtype=torch.float32).eval()
    cfg = LearnerConfig(model=str(tool_model))
    pad = policy.tokenizer.pad_token_id
    batch = make_batch(mixed, pad, "group", weights_version=2)
    assert batch.on_policy is not None and not bool(batch.on_policy.any())
    batch = make_batch(mixed, pad, "group", weights_version=0)
    with torch.no_grad():
        measured = batch_loss(model, batch, cfg, backward=False).mismatch
    current = make_batch(groups[1:], pad, "group")
    assert measured.tokens == current.num_tokens < batch.num_tokens
