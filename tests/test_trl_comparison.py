"""benchmarks/trl_comparison.py: TRL gets exactly our reward, and one TRL optimizer step is our
batch shape. The TRL parts are skipped where TRL is not installed (it is the `trl` extra)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tasks  # noqa: E402
import trl_comparison as bench  # noqa: E402
from fastrl import checks, util  # noqa: E402


def crafted(task):
    """Four training problems and, for each, a completion worth 1.0, 0.1, 0.0 and 0.0."""
    problems = [task.problem("train", i) for i in range(4)]
    completions = [f"<answer>{problems[0].answer}</answer>",  # a correct solution: 1.0
                   "<answer>1+1</answer>",  # well formed, wrong numbers: 0.1
                   f"<answer>{problems[2].answer}",  # no closing tag: 0.0
                   "no answer at all"]
    return problems, completions


def test_reward_adapter_matches_task_reward():
    """Called the way TRL calls a reward function (prompts, completions and the dataset's extra
    columns as lists, two completions per prompt), the adapter gives task.reward."""
    task = tasks.make_task("countdown", 1, tiny_prompts=True)
    problems, completions = crafted(task)
    rows = [i // 2 for i in range(8)]
    completions = [c for c in completions for _ in range(2)]
    rewards = bench.TaskReward(task)(prompts=[problems[i].prompt for i in rows], completions=completions, index=rows,
                                     trainer_state=None)
    assert rewards == [task.reward(c, problems[i]) for c, i in zip(completions, rows)]
    assert rewards == [1.0, 1.0, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0]


def test_reward_adapter_reads_conversational_completions():
    """With chat prompts TRL hands each completion as [{"role": "assistant", "content": text}]; the adapter scores its
    text with the arithmetic task's reward."""
    task = tasks.make_task("arithmetic", 1, tiny_prompts=False)
    problems = [task.problem("train", i) for i in range(2)]
    completions = [[{"role": "assistant", "content": f"The answer is {problems[0].target}."}],
                   [{"role": "assistant", "content": f"The answer is {problems[1].target + 1}."}]]
    reward = bench.TaskReward(task)
    assert reward.__name__ == "arithmetic"
    assert reward(prompts=[bench.chat_messages(p) for p in problems], completions=completions,
                  index=[0, 1]) == [1.0, 0.0]


def test_train_dataset_is_our_prompts():
    """TRL's dataset holds the prompts ours takes, in order, and its columns round-trip the reward."""
    pytest.importorskip("datasets")
    task = tasks.make_task("countdown", 1, tiny_prompts=True)
    problems, completions = crafted(task)
    rows = bench.train_dataset(task, 4)
    assert [r["prompt"] for r in rows] == [p.prompt for p in problems]
    rewards = bench.TaskReward(task)(prompts=rows["prompt"], completions=completions, index=rows["index"])
    assert rewards == [task.reward(c, p) for c, p in zip(completions, problems)] == [1.0, 0.1, 0.0, 0.0]


def test_train_dataset_under_the_chat_template_is_the_conversation_ours_templates():
    """Under the chat template TRL gets each problem as the conversation tasks.encode_prompts wraps: the task's system
    turn (arithmetic has none: the template's own) and its user turn."""
    pytest.importorskip("datasets")
    task = tasks.make_task("arithmetic", 1, tiny_prompts=False)
    rows = bench.train_dataset(task, 3, chat_template=True)
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": task.problem("train", i).user}]
                                           for i in range(3)]
    assert rows["index"] == [0, 1, 2]


@pytest.mark.parametrize("prompts, completions", [(32, 8), (8, 4)])
def test_trl_rloo_step_is_our_batch(tmp_path, prompts, completions):
    """One RLOOTrainer optimizer step generates P x G completions once and takes one step on them."""
    trl = pytest.importorskip("trl")
    w = bench.Workload("rloo", "unused", 3, prompts, completions, 0.8, 1e-4, 32, 1, 0, 16)
    config = trl.RLOOConfig(**bench.trl_config_kwargs(w, str(tmp_path)))
    assert config.generation_batch_size == prompts * completions
    assert config.steps_per_generation == config.gradient_accumulation_steps  # one generation per optimizer step
    assert config.num_iterations == 1 and config.num_generations == completions
    assert not config.bf16 and not config.gradient_checkpointing and config.lr_scheduler_type == "constant"


def test_accuracy_study_variants_reach_our_command_line():
    """Each --accuracy-variants entry is passed to rloo_kreuse.py after the shared flags (so it
    wins), and '' is ours as shipped."""
    w = bench.Workload("rloo", "unused", 3, 4, 2, 0.8, 1e-4, 32, 7, 20, 16)
    args = bench.Args(ours_rloo_extra="--kl-coef 0")
    shipped, no_entropy = bench.ours_flags(w, args, ""), bench.ours_flags(w, args, "--ent-coef 0")
    assert shipped[-2:] == ["--exp-name", "trl_cmp_rloo"] and "--kl-coef" not in shipped
    assert no_entropy[-2:] == ["--ent-coef", "0"] and no_entropy[:-2] == shipped
    assert bench.ours_flags(w, args)[-2:] == ["--kl-coef", "0"]  # no variant: --ours-rloo-extra
    assert shipped[shipped.index("--seed") + 1] == "7"


# --------------------------------------------------------------------------------------
# The SmolLM2 workload (--model smollm2): the same settings on both sides
# --------------------------------------------------------------------------------------


def smollm2_workloads(**changes):
    return bench.smollm2_workloads(bench.Args(model="smollm2", **changes), model_dir="unused", prompt_tokens=48)


def parse_ours(w):
    """Our script's own parse of the flags the benchmark gives it: what the run actually uses."""
    import online_dpo_async
    import rloo_kreuse

    flags = bench.ours_flags(w, bench.Args())
    if w.method == "rloo":
        return checks.parse_args(rloo_kreuse.Args, flags, paper=rloo_kreuse.PAPER, smollm2=rloo_kreuse.SMOLLM2)
    return online_dpo_async.parse_args(flags)


def test_smollm2_workloads_are_our_presets():
    """The SmolLM2 workloads are our scripts' --model smollm2 presets (arithmetic, chat template, 8 x 8 at lr 2e-5 with
    no KL for RLOO; 16 prompts at T 0.7 for online DPO, x 2 completions: TRL's), and the flags the benchmark gives our
    scripts parse to exactly the workload."""
    rloo, dpo = smollm2_workloads(smollm2_rloo_steps=7, smollm2_dpo_steps=9)
    assert (rloo.task, rloo.prompts, rloo.completions, rloo.learning_rate, rloo.kl_coef, rloo.max_new_tokens) == (
        "arithmetic", 8, 8, 2e-5, 0.0, 64)
    assert (rloo.temperature, rloo.top_p, rloo.steps, rloo.chat_template) == (0.8, 0.95, 7, True)
    assert (dpo.task, dpo.prompts, dpo.completions, dpo.temperature, dpo.top_p, dpo.steps, dpo.chat_template) == (
        "arithmetic", 16, 2, 0.7, 1.0, 9, True)
    for w in (rloo, dpo):
        assert (w.model, w.eval_problems, w.eval_samples) == ("smollm2", 50, 4)
        a = parse_ours(w)
        assert (a.model, a.task, a.chat_template, a.seed, a.num_rounds, a.num_prompts, a.group_size) == (
            "smollm2", w.task, True, w.seed, w.steps, w.prompts, w.completions)
        assert (a.learning_rate, a.temperature, a.top_p, a.max_new_tokens, a.max_prompt_tokens) == (
            w.learning_rate, w.temperature, w.top_p, w.max_new_tokens, w.max_prompt_tokens)
        assert (a.eval_problems, a.eval_samples, a.dtype, a.autocast_bf16, a.gradient_checkpointing) == (
            w.eval_problems, w.eval_samples, "float32", False, False)
    r, d = parse_ours(rloo), parse_ours(dpo)
    assert (r.k, r.kl_coef, r.ent_coef, r.max_grad_norm, r.tis, r.recompute_old_logprobs) == (1, 0.0, 0.0,
                                                                                              0.5, "auto", False)
    assert (d.staleness, d.beta, d.loss_type, d.max_grad_norm, d.missing_eos_penalty, d.eos_penalty_mode) == (
        1, 0.1, "dpo", 1.0, 1.0, "subtract")  # TRL's penalty: score - 1 for a completion without EOS
    assert r.micro_batch_tokens == 32 * (48 + 64) and rloo.micro_batch == 32  # 32 rows of the longest sequence a pass
    assert smollm2_workloads(smollm2_rloo_micro_batch=0)[0].ours_extra == ()  # 0: ours as the preset ships (one pass)


def test_smollm2_trl_config_is_our_settings():
    """TRL's configs for the SmolLM2 workloads carry the same numbers as our parsed flags: batch P x G in one optimizer
    step, the same lr, temperature, top-p (no top-k), max completion length, KL (none: no reference model), clipping,
    fp32, no gradient checkpointing, the prompts in order."""
    rloo, dpo = smollm2_workloads()
    r, d = parse_ours(rloo), parse_ours(dpo)
    kr, kd = bench.trl_config_kwargs(rloo, "unused"), bench.trl_config_kwargs(dpo, "unused")
    for k, a in ((kr, r), (kd, d)):
        assert (k["learning_rate"], k["temperature"], k["top_p"], k["top_k"], k["seed"]) == (
            a.learning_rate, a.temperature, a.top_p, 0, a.seed)
        assert (k["max_steps"], k["max_grad_norm"], k["lr_scheduler_type"], k["weight_decay"], k["adam_epsilon"]) == (
            a.num_rounds, a.max_grad_norm, "constant", 0.0, 1e-7)
        assert not k["bf16"] and not k["fp16"] and not k["gradient_checkpointing"] and k["use_cpu"]
    assert (kr["num_generations"], kr["max_completion_length"], kr["beta"], kr["num_iterations"],
            kr["shuffle_dataset"]) == (r.group_size, r.max_new_tokens, r.kl_coef, 1, False)
    assert kr["per_device_train_batch_size"] * kr["gradient_accumulation_steps"] == r.num_prompts * r.group_size
    assert kr["per_device_train_batch_size"] == 32 and kr["gradient_accumulation_steps"] == 2
    assert (kd["per_device_train_batch_size"], kd["gradient_accumulation_steps"], kd["max_new_tokens"], kd["beta"]) == (
        d.num_prompts, 1, d.max_new_tokens, d.beta)
    assert (kd["loss_type"], kd["missing_eos_penalty"], kd["train_sampling_strategy"]) == (
        "sigmoid", d.missing_eos_penalty, "sequential")


def test_smollm2_trl_configs_resolve_to_one_generation_per_step(tmp_path):
    """TRL's own config classes take the SmolLM2 kwargs: RLOO generates the step's 64 completions once, with no
    reference model (beta 0); online DPO reads the prompts in order."""
    trl = pytest.importorskip("trl")
    from trl.experimental.online_dpo import OnlineDPOConfig

    rloo, dpo = smollm2_workloads()
    config = trl.RLOOConfig(**bench.trl_config_kwargs(rloo, str(tmp_path)))
    assert config.generation_batch_size == 64 and config.steps_per_generation == config.gradient_accumulation_steps
    assert config.beta == 0.0 and config.top_p == 0.95 and config.max_completion_length == 64
    dpo_config = OnlineDPOConfig(**bench.trl_config_kwargs(dpo, str(tmp_path)))
    assert dpo_config.train_sampling_strategy == "sequential" and dpo_config.max_new_tokens == 64
    assert dpo_config.max_length >= 128 + 64  # prompt + completion: TRL truncates nothing


def test_smollm2_prompts_are_the_same_token_ids_on_both_sides():
    """The first training prompts, as TRL 1.16's own code tokenizes the dataset's conversation (RLOO:
    apply_chat_template with tokenize=True; online DPO: the templated text, tokenized without special tokens), are the
    ids our scripts send the sampler (tasks.encode_prompts under the chat template). Needs the converted SmolLM2
    (skipped until it is cached)."""
    pytest.importorskip("trl")
    from fastrl import smollm2

    path = util.CACHE_DIR / f"smollm2-135m-instruct-{smollm2.VERSION}"
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip("SmolLM2 is not converted yet (--model smollm2 builds it once)")
    tokenizer = util.load_tokenizer(str(path))
    # (prompt_tokens measured: 48)
    workloads = bench.smollm2_workloads(bench.Args(model="smollm2"), model_dir=str(path))
    assert workloads[0].ours_extra == ("--micro-batch-tokens", str(32 * (48 + 64)))
    for w in workloads:
        dataset = bench.train_dataset(bench.make_task(w), 3, w.chat_template)
        for i in range(3):
            ours = bench.our_prompt_ids(w, tokenizer, i)
            assert bench.trl_prompt_ids(w.method, dataset[i]["prompt"], tokenizer) == ours
            assert tokenizer.decode(ours).startswith("<|im_start|>system\n")
            assert tokenizer.decode(ours).endswith(f"{bench.make_task(w).problem('train', i).user}<|im_end|>\n"
                                                   "<|im_start|>assistant\n")
