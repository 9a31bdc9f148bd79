"""fastrl/cpu_memory.py: the CPU learner's micro-batch token budget from the machine's memory (issue 50, item 1).

- The planner's arithmetic on SmolLM2's shape (hand-made numbers, no weights): the largest budget that fits, a given
  budget kept or refused in one line naming the one that fits, a machine too small for one sequence refused naming
  --model; each script's --model smollm2 preset planned within PLANNED (the issue's 4 GB goal is not met yet).
- Measured, not estimated (slow): one RLOO learner step on the real SmolLM2 at the planned budget, in a fresh
  process, peaks within 10% of the plan's estimate (ru_maxrss)."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastrl import checks, cpu_memory, memory_plan

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
# SmolLM2-135M-Instruct (memory_plan.shape_of of its config)
SMOLLM2 = memory_plan.Shape(params=134515008, critic_params=134515584, largest=28311552, layers=30, hidden=576,
                            intermediate=1536, heads=9, kv_dim=192, vocab=49152)
# the learner at the plan today (the goal, 4 GB and PPO's 8, needs the vocabulary part's chunk smaller on a
# CPU as well: docs/results.md, "Where the learner's memory goes on a CPU")
PLANNED = {"rloo": 5 * GB, "dpo": 5 * GB, "pipeline": 5 * GB, "ppo": 7.5 * GB}


def rloo_args(**changes):
    """RLOO's --model smollm2 flags as the planner reads them."""
    return SimpleNamespace(**(dict(max_prompt_tokens=128, max_new_tokens=64, num_prompts=8, group_size=8, kl_coef=0.0,
                                   top_p=0.95, micro_batch_tokens=None, model="smollm2") | changes))


def preset_args(method: str):
    """A script's Args at its --model smollm2 defaults (their --micro-batch-tokens included)."""
    import online_dpo_async as dpo
    import pipeline_rl as pipeline
    import ppo_oppo as ppo
    import rloo_kreuse as rloo

    module = {"rloo": rloo, "dpo": dpo, "pipeline": pipeline, "ppo": ppo}[method]
    args = checks.model_defaults(module.Args, "smollm2", module.PAPER, module.SMOLLM2)
    return SimpleNamespace(**vars(args))


def test_a_big_machine_gets_the_cpu_knee_and_a_smaller_one_less():
    assert cpu_memory.budget_for("rloo", rloo_args(), SMOLLM2, 24 * GB) == cpu_memory.CPU_BUDGETS[0]
    small = cpu_memory.budget_for("rloo", rloo_args(), SMOLLM2, 6.5 * GB)
    assert small < cpu_memory.CPU_BUDGETS[0]
    room = 6.5 * GB - cpu_memory.sampler_resident_bytes(rloo_args(), SMOLLM2)
    assert cpu_memory.learner_resident_bytes("rloo", rloo_args(), SMOLLM2, small) <= room
    larger = cpu_memory.CPU_BUDGETS[cpu_memory.CPU_BUDGETS.index(small) - 1]
    assert cpu_memory.learner_resident_bytes("rloo", rloo_args(), SMOLLM2, larger) > room  # the largest that fits


def test_a_given_budget_is_kept_when_it_fits_and_refused_in_one_line_naming_one_that_fits():
    assert cpu_memory.budget_for("rloo", rloo_args(micro_batch_tokens=8192), SMOLLM2, 64 * GB) == 8192
    with pytest.raises(SystemExit) as refused:
        cpu_memory.budget_for("rloo", rloo_args(micro_batch_tokens=8192), SMOLLM2, 12 * GB)
    line = str(refused.value)
    assert line.startswith("error: --micro-batch-tokens 8192: the learner needs ~") and "\n" not in line
    assert "this machine has 12.0 GB available; --micro-batch-tokens 1024 fits" in line


def test_a_machine_too_small_for_one_sequence_is_refused_naming_the_model():
    with pytest.raises(SystemExit) as refused:
        cpu_memory.budget_for("rloo", rloo_args(), SMOLLM2, 4 * GB)
    line = str(refused.value)
    assert line.startswith("error: --model smollm2: needs ~") and "this machine has 4.0 GB available" in line
    # a remote sampler (--sampler-url) takes nothing here
    assert cpu_memory.budget_for("rloo", rloo_args(sampler_url=("http://x:8000",)), SMOLLM2, 4 * GB) >= 64


@pytest.mark.parametrize("method", ["rloo", "dpo", "pipeline", "ppo"])
def test_each_smollm2_preset_is_planned_under_the_goal(method):
    """Each preset's --micro-batch-tokens fits this 24 GB machine beside its sampler, its learner within PLANNED."""
    args = preset_args(method)
    budget = cpu_memory.budget_for(method, args, SMOLLM2, 24 * GB)
    assert budget == args.micro_batch_tokens == {"ppo": 512}.get(method, 1024)
    planned = memory_plan.with_defaults(method, args)
    assert cpu_memory.learner_resident_bytes(method, planned, SMOLLM2, budget) <= PLANNED[method]


def test_release_freed_memory_applies_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert cpu_memory.release_freed_memory()


STEP = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import torch
from fastrl import cpu_memory
released = cpu_memory.release_freed_memory()
import common, rloo_kreuse as rloo
from transformers import AutoTokenizer
from types import SimpleNamespace
torch.set_num_threads(2)
path = common.resolve_model("smollm2")
args = SimpleNamespace(**vars(rloo.Args(**rloo.SMOLLM2)))  # the preset; the budget planned on a 24 GB machine
args.micro_batch_tokens = None
budget = cpu_memory.plan(args, path, "rloo", available=24e9)
policy = common.load_policy(path, "cpu")
tokenizer = AutoTokenizer.from_pretrained(path)
optimizer = torch.optim.Adam(policy.parameters(), lr=1e-9, eps=1e-7, fused=True)
question = "What is 63 - 15? Give the final answer as a number."
prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                       tokenize=False)
prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # the preset's prompts: 48 tokens
text = "63 - 15 = 48. To find the answer, subtract 10 from 63 to get 53, then 5 more to get 48. The answer is 48. " * 3
response = tokenizer(text, add_special_tokens=False)["input_ids"][:args.max_new_tokens]  # every response at the cap
rows = 2 * max(1, budget // (len(prompt) + len(response)))  # two full micro-batches: the gradients exist for the second
ids, attn, cmask = common.pad_prompt_completions([prompt] * rows, [response] * rows, tokenizer.pad_token_id)
lengths = [len(prompt) + len(response)] * rows
advantages = torch.linspace(-1, 1, rows)
mask = cmask[:, 1:].float()

def loss_fn(mb):
    r = mb.items
    logp, entropy = common.token_logprobs(policy, ids[r, :mb.width], attn[r, :mb.width], cmask[r, :mb.width],
                                          temperature=args.temperature, top_p=args.top_p, with_entropy=True)
    m = mask[r, :logp.shape[1]]
    return -(advantages[r] * (logp * m).sum(1) / m.sum(1)).mean(), len(r), {}

for _ in range(2):  # the second step with Adam's moments alive: the run's steady state
    for mb in common.micro_batch_plan(lengths, budget):  # the scripts' update loop
        mb_loss, size, _ = loss_fn(mb)
        (mb_loss * size / rows).backward()
    optimizer.step()
    optimizer.zero_grad()
print(json.dumps(dict(budget=budget, rows=rows, released=released,
                      peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


@pytest.mark.slow
def test_one_rloo_learner_step_on_smollm2_at_the_planned_budget_peaks_where_the_plan_says():
    """Measured: the learner process's peak resident memory (ru_maxrss) over two RLOO steps at the preset's shape
    (prompts of the preset's task, responses at --max-new-tokens) at the budget planned on a 24 GB machine. A step's
    peak is that of one micro-batch beside the models (gradients, Adam): two micro-batches a step show it."""
    done = subprocess.run([sys.executable, "-c", STEP, str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["budget"] == cpu_memory.CPU_BUDGETS[0] and result["released"]
    planned = cpu_memory.learner_resident_bytes("rloo", rloo_args(max_prompt_tokens=48), SMOLLM2, result["budget"])
    assert result["peak_mib"] * 2**20 <= 1.1 * planned, (result, planned / 2**20)
    assert result["peak_mib"] * 2**20 <= PLANNED["rloo"], result
