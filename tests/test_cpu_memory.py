"""fastrl/cpu_memory.py: the CPU learner's micro-batch token budget from the machine's memory (issue 50, item 1).

- The planner's arithmetic on SmolLM2's shape (hand-made numbers, no weights): the largest budget that fits, a given
  budget kept or refused in one line naming the one that fits, a machine too small for one sequence refused naming
  --model; each script's --model smollm2 preset planned within PLANNED.
- Measured, not estimated (slow): each script's own learner step at its SmolLM2 preset's shape, in a fresh process,
  peaks within 10% of the plan's estimate and under the goal (ru_maxrss)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fastrl import checks, cpu_memory, memory_plan, util
from conftest import WORKLOADS as W  # each script's memory_plan.Workload, by its short name

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
# SmolLM2-135M-Instruct (memory_plan.shape_of of its config)
SMOLLM2 = memory_plan.Shape(params=134515008, critic_params=134515584, largest=28311552, layers=30, hidden=576,
                            intermediate=1536, heads=9, kv_dim=192, vocab=49152)
# a run's learner as planned for the worst case (every prompt at --max-prompt-tokens 128, the run's vLLM modules and
# tokenizer), fp32 or bf16: measured steps are below (test_one_learner_step_at_the_smollm2_presets_shape_peaks_under_
# the_goal), the runs' peaks (48-token prompts) 3.8-4.0 GB, PPO 7.2 (docs/results.md)
PLANNED = {"rloo": 4.2 * GB, "dpo": 4.35 * GB, "pipeline": 3.8 * GB, "ppo": 7.4 * GB}


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
    assert cpu_memory.budget_for(W["rloo"], rloo_args(), SMOLLM2, 24 * GB) == cpu_memory.CPU_BUDGETS[0]
    small = cpu_memory.budget_for(W["rloo"], rloo_args(), SMOLLM2, 7 * GB)
    assert small < cpu_memory.CPU_BUDGETS[0]
    room = 7 * GB - cpu_memory.sampler_resident_bytes(rloo_args(), SMOLLM2)
    assert cpu_memory.learner_resident_bytes(W["rloo"], rloo_args(), SMOLLM2, small) <= room
    larger = cpu_memory.CPU_BUDGETS[cpu_memory.CPU_BUDGETS.index(small) - 1]
    assert cpu_memory.learner_resident_bytes(W["rloo"], rloo_args(), SMOLLM2, larger) > room  # the largest that fits


def test_a_given_budget_is_kept_when_it_fits_and_refused_in_one_line_naming_one_that_fits():
    assert cpu_memory.budget_for(W["rloo"], rloo_args(micro_batch_tokens=8192), SMOLLM2, 64 * GB) == 8192
    with pytest.raises(SystemExit) as refused:
        cpu_memory.budget_for(W["rloo"], rloo_args(micro_batch_tokens=8192), SMOLLM2, 12 * GB)
    line = str(refused.value)
    assert line.startswith("error: --micro-batch-tokens 8192: the learner needs ~") and "\n" not in line
    assert "this machine has 12.0 GB available; --micro-batch-tokens 1024 fits" in line


def test_a_machine_too_small_for_one_sequence_is_refused_naming_the_model():
    with pytest.raises(SystemExit) as refused:
        cpu_memory.budget_for(W["rloo"], rloo_args(), SMOLLM2, 4 * GB)
    line = str(refused.value)
    assert line.startswith("error: --model smollm2: needs ~") and "this machine has 4.0 GB available" in line
    # a remote sampler (--sampler-url) takes nothing here
    assert cpu_memory.budget_for(W["rloo"], rloo_args(sampler_url=("http://x:8000",)), SMOLLM2, 4 * GB) >= 64


def test_the_push_adds_a_copy_of_the_weights_only_where_the_learner_cannot_train_in_the_shared_buffer():
    """shm_transfer: an fp32 sampler maps the learner's own parameters, so a push from the caller holds nothing more;
    a bf16 sampler's cast buffer and PipelineRL's background snapshot each hold one copy in the sampler's dtype (fp32
    SmolLM2: 538 MB, what its --background-push run measured above its step); a server's gloo buffers one more."""
    def pipeline(**changes):
        return memory_plan.with_defaults(W["pipeline"], SimpleNamespace(**(dict(
            max_prompt_tokens=128, max_new_tokens=64, train_batch_size=32, group_size=8, micro_batch_tokens=640,
            mode="pipeline", background_push=False, sampler_dtype="auto") | changes)))

    weights = SMOLLM2.params * 4
    assert cpu_memory.push_resident_bytes(W["pipeline"], pipeline(), SMOLLM2) == 0
    assert cpu_memory.push_resident_bytes(W["rloo"], rloo_args(), SMOLLM2) == 0
    assert cpu_memory.push_resident_bytes(W["pipeline"], pipeline(background_push=True), SMOLLM2) == weights
    assert cpu_memory.push_resident_bytes(W["pipeline"], pipeline(mode="conventional", background_push=True),
                                          SMOLLM2) == 0  # Conventional RL pushes between its RL steps
    assert cpu_memory.push_resident_bytes(W["rloo"], rloo_args(sampler_dtype="bfloat16"), SMOLLM2) == weights / 2
    assert cpu_memory.push_resident_bytes(W["pipeline"], pipeline(background_push=True, sampler_dtype="bfloat16"),
                                          SMOLLM2) == weights / 2  # the snapshot is kept in the sampler's dtype
    assert cpu_memory.push_resident_bytes(W["pipeline"], pipeline(background_push=True, sampler_url=("http://x:8000",)),
                                          SMOLLM2) == 2 * weights
    # bf16's rounding into an fp32 sampler: the cast's buffer; error feedback: its bf16 residual on top
    assert cpu_memory.push_resident_bytes(W["rloo"], rloo_args(push_round_to="bfloat16"), SMOLLM2) == weights
    assert cpu_memory.push_resident_bytes(W["rloo"], rloo_args(sampler_dtype="bfloat16",
                                                               push_rounding="error-feedback"), SMOLLM2) == weights
    planned = [cpu_memory.learner_resident_bytes(W["pipeline"], pipeline(background_push=b), SMOLLM2, 640)
               for b in (False, True)]
    assert planned[1] - planned[0] == weights


@pytest.mark.parametrize("method", ["rloo", "dpo", "pipeline", "ppo"])
def test_each_smollm2_preset_is_planned_under_the_goal(method):
    """Each preset's --micro-batch-tokens fits this 24 GB machine beside its sampler, its learner within PLANNED."""
    args = preset_args(method)
    budget = cpu_memory.budget_for(W[method], args, SMOLLM2, 24 * GB)
    assert budget == args.micro_batch_tokens == {"dpo": 384}.get(method, 512)
    planned = memory_plan.with_defaults(W[method], args)
    assert cpu_memory.learner_resident_bytes(W[method], planned, SMOLLM2, budget) <= PLANNED[method]


def test_the_learner_returns_freed_memory_only_where_mallocs_retention_would_not_fit(monkeypatch):
    """glibc's own malloc is ~1.4x faster a SmolLM2 step (benchmarks/malloc_modes.py) and keeps more: the plan releases
    freed memory (and says so in one line) only on a machine where what malloc keeps would not fit."""
    args = preset_args("rloo")
    args = memory_plan.with_defaults(W["rloo"], args)
    sampler = cpu_memory.sampler_resident_bytes(args, SMOLLM2)
    need = {released: cpu_memory.learner_resident_bytes(W["rloo"], args, SMOLLM2, 512, released=released)
            for released in (True, False)}
    assert need[False] - need[True] > 0.5 * GB  # (one micro-batch's activations and more: GLIBC_RETAINED)
    assert cpu_memory.release_needed(W["rloo"], args, SMOLLM2, 512, 24 * GB) == (512, False, None)
    tight = cpu_memory.release_needed(W["rloo"], args, SMOLLM2, 512, sampler + (need[True] + need[False]) / 2)
    assert tight.release and tight.budget == 512 and "\n" not in tight.why
    assert tight.why.startswith("memory: the learner returns what it frees as it goes") and " GB are left " in tight.why
    smaller = int(tight.why.rsplit("--micro-batch-tokens ", 1)[1].split()[0])  # (384 tokens cost 1.02x, not 1.4x)
    room = (need[True] + need[False]) / 2
    assert tight.why.endswith(" fits without it") and smaller < 512
    assert cpu_memory.learner_resident_bytes(W["rloo"], args, SMOLLM2, smaller, released=False) <= room
    larger = cpu_memory.CPU_BUDGETS[cpu_memory.CPU_BUDGETS.index(smaller) - 1]
    assert larger == 512 or cpu_memory.learner_resident_bytes(W["rloo"], args, SMOLLM2, larger, released=False) > room
    for name, value in cpu_memory.ONEDNN_CACHE_ENV.items():
        monkeypatch.setenv(name, value)  # (this process's environment stays as it was)
    assert cpu_memory.release_freed_memory(glibc=False) is False  # (oneDNN's caches only: no mallopt)


@pytest.mark.slow
def test_a_run_the_machine_cannot_hold_stops_in_one_line_and_leaves_no_sampler(monkeypatch, tiny_path):
    """The sampler starts before the CPU memory plan (its vLLM import overlaps the plan's transformers import:
    benchmarks/startup.py 1.23x to the first round), which reads the memory available before the sampler's start: when
    nothing fits, the one line comes and the sampler, still importing, is stopped (no process left)."""
    import rloo_kreuse as rk
    from fastrl import vllm_sampler
    from fastrl.run import Run
    import common
    import tasks
    import torch

    if torch.cuda.is_available():
        pytest.skip("the memory plan of a CPU learner")
    monkeypatch.setattr(cpu_memory, "available_bytes", lambda: 0.05 * GB)
    args = checks.parse_args(rk.Args, ["--model", "tiny", "--num-rounds", "1"], paper=rk.PAPER)
    with pytest.raises(SystemExit) as refused:
        Run(args, memory_plan.GROUPS, tasks.HUB_TASKS, common.resolve_model)
    line = str(refused.value)
    assert line.startswith("error: --micro-batch-tokens 8192: the learner needs ~") and "\n" not in line
    assert "this machine has 0.1 GB available" in line
    assert not vllm_sampler._LIVE_SAMPLERS


def test_release_freed_memory_applies_on_glibc(monkeypatch):
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    for name, value in cpu_memory.ONEDNN_CACHE_ENV.items():
        monkeypatch.setenv(name, value)  # (this process's environment stays as it was)
    assert cpu_memory.release_freed_memory()


def test_the_learner_bounds_onednns_caches_and_the_sampler_keeps_their_defaults(monkeypatch):
    """release_freed_memory sets oneDNN's cache sizes for the learner (read at its first bf16 product), keeps a
    user's own value, and learner_environment_removed takes out only what it set, as Sampler.start does around the
    sampler's spawn."""
    monkeypatch.setattr(cpu_memory, "_learner_env", {})
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")  # (so that the end of the test removes it again)
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")  # the user's
    cpu_memory.release_freed_memory()
    capped = cpu_memory.ONEDNN_CACHE_ENV["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == capped
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"
    with cpu_memory.learner_environment_removed():
        assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ and os.environ["LRU_CACHE_CAPACITY"] == "7"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == capped


PRESET_STEP = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/benchmarks")
from fastrl import cpu_memory
released = cpu_memory.release_freed_memory(sys.argv[4] == "release")  # as Run does, before any weight loads
import torch
import common, memory
from transformers import AutoConfig
torch.set_num_threads(2)
method = sys.argv[2]
config = AutoConfig.from_pretrained(common.resolve_model("smollm2"))
# released: two micro-batches at the preset's budget (the gradients exist for the second; the peak is one micro-batch's:
# RLOO 3,399 MiB at 2 and 3,401 at 5, DPO 3,437 at 2 and 3,441 at 8, PipelineRL 3,397 at 2 and 3,400 at 8); under
# glibc's own malloc, whose retention grows over the first few, five (RLOO: 3,842 MiB at 2, 4,064 at 5, 3,999 at 8,
# 4,048 at the preset's 16); PPO: one optimizer step of its round, a minibatch of 16 episodes, after the prefill of
# 16 + the Delta carried (at 8: 38 MiB lower)
shape = dict(rloo=dict(prompts=1, group=8), dpo=dict(pairs=2, group=2), pipeline=dict(batch_size=8),
             ppo=dict(batch_size=16))[method]
if sys.argv[4] == "keep":
    shape = dict(rloo=dict(prompts=2, group=9))[method]
autocast = sys.argv[3] == "bf16"  # the preset's fp32, or --autocast-bf16
info = memory.STEPS[method](config, model="smollm2", prompt=48, response=64, autocast=autocast, **shape)
print(json.dumps(dict(info, released=released, autocast=autocast,
                      peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""
# the issue's goal for the learner (4 GB; 8 for PPO's three models), met by the presets' micro-batches in fp32 and under
# --autocast-bf16 (measured: RLOO at 512 tokens 3,401 and 3,459 MiB, DPO at 384 3,441 (its frozen reference: 3,917 at
# 640), PipelineRL at 512 3,400, PPO at 512 6,535 and 6,612)
MEASURED = {precision: {"rloo": 4.0 * GB, "dpo": 4.0 * GB, "pipeline": 4.0 * GB, "ppo": 8.0 * GB}
            for precision in ("fp32", "bf16")}
# a machine whose memory is tight (the plan's release: each method), or one with room (glibc's own malloc: RLOO's)
CASES = ([(m, "fp32", "release") for m in ("rloo", "dpo", "pipeline", "ppo")] + [("rloo", "fp32", "keep")]
         + [("rloo", "bf16", "release")])  # bf16: opt-in, one suffices


@pytest.mark.slow
@pytest.mark.parametrize("method,precision,malloc", CASES, ids=["-".join(c) for c in CASES])
def test_one_learner_step_at_the_smollm2_presets_shape_peaks_under_the_goal(method, precision, malloc):
    """Measured, not estimated: the peak resident memory (ru_maxrss) of a fresh process running the script's own
    learner step (benchmarks/memory.py: its micro-batch loss, the update loop, clipping, Adam with its moments) on
    SmolLM2's shape at the --model smollm2 preset: prompts of its task's length (48 tokens), responses at
    --max-new-tokens, --micro-batch-tokens, its reference and critic where it has them; in the preset's fp32 and
    (where the CPU has native bf16) under --autocast-bf16; returning freed memory as it goes (the plan's release) or
    under glibc's own malloc. Within 10% of cpu_memory's plan, and (released) under MEASURED."""
    if precision == "bf16" and not util.cpu_bf16():
        pytest.skip("this CPU has no native bf16: --autocast-bf16 would be emulated")
    done = subprocess.run([sys.executable, "-c", PRESET_STEP, str(ROOT), method, precision, malloc],
                          capture_output=True, text=True, timeout=1800)  # a hang guard (PPO: 77 s alone, 252 in CI)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["released"] == (malloc == "release") and result["micro_batches"] >= 2
    assert result["autocast"] == (precision == "bf16")
    args = preset_args(method)
    args.max_prompt_tokens, args.autocast_bf16 = 48, result["autocast"]
    planned = cpu_memory.learner_resident_bytes(W[method], memory_plan.with_defaults(W[method], args), SMOLLM2,
                                                args.micro_batch_tokens, released=malloc == "release")
    peak = result["peak_mib"] * 2**20
    assert 0.8 * planned <= peak <= 1.1 * planned, (result, planned / 2**20)
    assert malloc == "keep" or peak <= MEASURED[precision][method], result


def test_the_plan_keeps_the_vocabulary_parts_constants_of_common():
    import common

    assert (memory_plan.SAVED_LOGPROB_BYTES, memory_plan.SAVED_CHUNK_BYTES, memory_plan.LOGIT_CHUNK_BYTES) == \
        (common.SAVED_LOGPROB_BYTES, common.SAVED_CHUNK_BYTES, common.LOGIT_CHUNK_BYTES)
