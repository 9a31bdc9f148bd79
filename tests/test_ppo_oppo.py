"""PPO with OPPO: chunked prefill = full forward for critic, reference (top-p) and a reward model,
and the RM score = transformers' with pad == eos; GAE, the PPO losses and TIS by hand; NaN steps
skipped; the flags' defaults and checks; the Delta controller and chunk tuner on scripted inputs;
carried-over sequences resuming on the real sampler; OPPO at Delta 0 = plain PPO; every ablation and
the realistic model from the command line."""

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

import common
from fastrl import checks, runlog, util
import ppo_oppo as po
import tasks
from conftest import run_stripped_copy, strip_to_method, without_after_round

ROOT = Path(__file__).resolve().parents[1]


def test_the_critic_starts_from_the_reward_model_when_one_is_given(tiny_path, tiny_reward_model):
    rm_score = util.load_hf(AutoModelForSequenceClassification, tiny_reward_model, num_labels=1).score.weight
    _, critic, _, rm = common.load_networks(tiny_path, "cpu", torch.float32, reward_model=tiny_reward_model)
    assert torch.equal(critic.score.weight, rm_score) and critic.score.weight.data_ptr() != rm.score.weight.data_ptr()
    _, critic, _, _ = common.load_networks(tiny_path, "cpu", torch.float32, reward_model=tiny_reward_model,
                                       critic_model=tiny_path)
    assert not torch.equal(critic.score.weight, rm_score)  # --critic-model: the policy's checkpoint, a fresh head
    _, critic, _, rm = common.load_networks(tiny_path, "cpu", torch.float32)
    assert rm is None and not torch.equal(critic.score.weight, rm_score)
    # the policy's checkpoint: a new head drawn as OpenRLHF's (std 1/(d+1)), not HF's 0.02 (V at +-1 on SmolLM2)
    std = 1 / (critic.config.hidden_size + 1)
    assert abs(critic.score.weight.std().item() - std) < 0.25 * std and abs(critic.score.weight.mean()) < 0.25 * std


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_equals_full_forward(tiny_path, tokenizer, tiny_reward_model, chunk):
    """Responses arrive in chunks of `chunk` tokens (plus a per-sequence offset, so chunk borders
    fall at different places mid-sequence); each chunk is prefilled on top of the cached prefix,
    batched with other sequences. Values, reference logprobs and RM scores must equal one full
    forward of the whole padded batch (the reference's under the sampler's temperature and top-p)."""
    torch.manual_seed(0)
    critic = util.load_hf(AutoModelForSequenceClassification, tiny_path, quiet=True, num_labels=1).eval()
    ref = common.load_policy(tiny_path, "cpu").eval()
    rm = util.load_hf(AutoModelForSequenceClassification, tiny_reward_model, num_labels=1).eval()
    rm.config.pad_token_id = tokenizer.pad_token_id
    models = dict(critic=critic, ref=ref, rm=rm)
    prompts = [tokenizer(p)["input_ids"] for p in ("1 2 3->6:", "4 5 9->20:", "7 8 9->56:")]
    responses = [torch.randint(3, len(tokenizer), (n,)).tolist() for n in (13, 5, 21)]
    rollouts = [po.Rollout(str(i), i, None, p, 0, prefix={name: po.Prefix() for name in models})
                for i, p in enumerate(prompts)]
    for name, model in models.items():  # the prompts, before any response token
        po.prefill(name, model, rollouts, 0.7, micro_batch_size=2, top_p=0.9)
    done = [0, 0, 0]
    while any(d < len(r) for d, r in zip(done, responses)):
        for i, r in enumerate(rollouts):
            done[i] = min(len(responses[i]), done[i] + chunk + i)
            r.response = responses[i][:done[i]]
        for name, model in models.items():
            po.prefill(name, model, rollouts, 0.7, micro_batch_size=2, top_p=0.9)

    ids, attn, cmask = common.pad_prompt_completions(prompts, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        full_logp = common.token_logprobs(ref, ids, attn, cmask, 0.7, top_p=0.9)
        assert (full_logp - common.token_logprobs(ref, ids, attn, cmask, 0.7)).abs().max() > 1e-3  # top-p really cuts
        full_values = po.critic_values(critic, ids, attn, cmask)
        full_scores = rm(input_ids=ids, attention_mask=attn).logits[:, 0]
    for i, r in enumerate(rollouts):
        start, T = len(prompts[i]) - 1, len(responses[i])
        assert r.prefix["ref"].length == len(prompts[i]) + T
        torch.testing.assert_close(po.scored(r, "ref", ref), full_logp[i, start:start + T], atol=1e-4, rtol=0)
        torch.testing.assert_close(po.scored(r, "critic", critic), full_values[i, start:start + T], atol=1e-4, rtol=0)
        torch.testing.assert_close(po.scored(r, "rm", rm), full_scores[i], atol=1e-4, rtol=0)
    assert full_scores.std() > 1e-3  # the random head gives the sequences different scores


def test_gae_by_hand():
    # sequence 0: 3 tokens; sequence 1: 1 token then padding (zeros)
    rewards = torch.tensor([[0.0, -0.1, 1.0], [0.5, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.3, 0.0, 0.0]])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.6
    d1 = -0.1 + gamma * 0.6 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.2
    a2, a1 = d2, d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    expected = torch.tensor([[a0, a1, a2], [0.5 - 0.3, 0.0, 0.0]])
    torch.testing.assert_close(po.gae(rewards, values, gamma, lam), expected)


def test_ppo_losses_by_hand():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]])  # ratios e^0.5 (clipped at 1.2) and 1
    adv = torch.tensor([[1.0, -2.0]])
    v_pred = torch.tensor([[0.5, 0.0]])
    v_old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    mask = torch.ones(1, 2)
    pg, vf, stats = po.ppo_losses(logp, old, adv, v_pred, v_old, returns, mask, clip_coef=0.2, vf_clip=0.2)
    ratio0 = torch.e ** 0.5
    assert pg.item() == pytest.approx((max(-ratio0, -1.2) + 2.0) / 2)
    # value 0.5 clipped to 0.2: max((0.5-1)^2, (0.2-1)^2) = 0.64; second token: 1
    assert vf.item() == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    pg.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped: no gradient through the first token


def test_delta_controller_follows_algorithm1():
    # nothing moves before 2W rewards
    assert po.next_delta(8, [0.1, 0.2, 0.3], window=2, delta_min=0, delta_max=16, rule="eq4") == (8, [0.1, 0.2, 0.3])
    rising, falling, flat = [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.2, 0.2, 0.2, 0.2]
    # change = max(1, floor(Delta / 4)); history keeps the last W
    assert po.next_delta(8, rising, 2, 0, 16, "eq4") == (10, [0.3, 0.4])
    assert po.next_delta(8, falling, 2, 0, 16, "eq4") == (6, [0.2, 0.1])
    assert po.next_delta(3, rising, 2, 0, 16, "eq4")[0] == 4  # floor(3/4) = 0 -> change 1
    assert po.next_delta(8, flat, 2, 0, 16, "eq4")[0] == 6  # Eq. 4: s <= 0 shrinks
    # Algorithm 1 line 25 as printed: Delta - sign(d) * change
    assert po.next_delta(8, rising, 2, 0, 16, "alg1")[0] == 6
    assert po.next_delta(8, falling, 2, 0, 16, "alg1")[0] == 10
    assert po.next_delta(8, flat, 2, 0, 16, "alg1")[0] == 8  # sign(0) = 0
    # clipped to [Delta_min, Delta_max]
    assert po.next_delta(15, rising, 2, 0, 16, "eq4")[0] == 16
    assert po.next_delta(1, falling, 2, 1, 16, "eq4")[0] == 1

    # a scripted training run: the reward climbs for 12 rounds, then plateaus and falls
    series = [0.1 + 0.05 * i for i in range(12)] + [0.7] * 4 + [0.7 - 0.05 * i for i in range(8)]
    delta, history, trace = 8, [], []
    for r in series:
        history.append(r)
        delta, history = po.next_delta(delta, history, 2, 0, 16, "eq4")
        trace.append(delta)
    assert max(trace[:12]) == 16 and trace[-1] < trace[11]  # grows while learning, decays afterwards


def test_chunk_tuner_tries_every_candidate_then_keeps_the_fastest():
    """Overlap.next_chunk (the tuner, formerly chunk_for_round) on scripted rollout seconds."""
    candidates, every, overlap, used = (4, 8, 16), 6, po.Overlap(0, 8, (4, 8, 16)), []
    fake_seconds = {4: 0.9, 8: 0.5, 16: 0.7}
    for round_index in range(14):
        used.append(overlap.next_chunk(round_index, every))
        if round_index % every < len(candidates):
            overlap.trial_seconds[overlap.chunk] = fake_seconds[overlap.chunk]
    assert used == [4, 8, 16, 8, 8, 8, 4, 8, 16, 8, 8, 8, 4, 8]
    assert po.Overlap(0, 32, candidates).next_chunk(5, 0) == 32  # tuning off


def test_overlap_state_runs_both_controllers_as_the_loop_did():
    """main()'s OPPO state object: next_chunk at a round's start and update after its PPO step give the chunk schedule
    of the tuner above and the Delta trace of next_delta, from one object a checkpoint saves."""
    args = po.Args(delta=8, delta_window=2, delta_min=0, delta_max=16, delta_rule="eq4", chunk_tune_every=6)
    overlap = po.Overlap(args.delta, 8, (4, 8, 16))
    fake_seconds, used, deltas = {4: 0.9, 8: 0.5, 16: 0.7}, [], []
    rewards = [0.1 + 0.05 * i for i in range(14)]
    delta, history = 8, []
    for round_index, reward in enumerate(rewards):
        used.append(overlap.next_chunk(round_index, args.chunk_tune_every))
        overlap.update(args, round_index, reward, fake_seconds[overlap.chunk])
        history.append(reward)
        delta, history = po.next_delta(delta, history, 2, 0, 16, "eq4")
        deltas.append((overlap.delta, delta))
    assert used == [4, 8, 16, 8, 8, 8, 4, 8, 16, 8, 8, 8, 4, 8]
    assert all(a == b for a, b in deltas) and overlap.reward_history == history and overlap.delta == 16
    pinned = po.Overlap(0, 8, (4, 8, 16))  # --delta 0: no over-commitment, whatever the reward does
    for round_index, reward in enumerate(rewards):
        pinned.update(po.Args(delta=0), round_index, reward, 1.0)
    assert pinned.delta == 0 and len(pinned.reward_history) == len(rewards)


def test_rm_score_is_where_transformers_reads_it_with_pad_equal_eos(realistic_path):
    """A Qwen2ForSequenceClassification reward model with the realistic tokenizer (pad == eos):
    transformers scores the rightmost non-pad token, so a response that ends in EOS is scored at
    the token before. The streamed, chunked score must equal transformers' logits for the same ids:
    alone, in a right-padded and in a left-padded batch."""
    tokenizer = util.load_tokenizer(realistic_path)
    pad = eos = tokenizer.eos_token_id
    assert tokenizer.pad_token_id == eos
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, pad_token_id=pad, eos_token_id=eos, num_labels=1)).eval()
    with torch.no_grad():
        rm.score.weight.normal_(0, 1.0)
    prompts = [tokenizer(p)["input_ids"] for p in ("Using the numbers [1, 2, 3]", "equals 20", "Assistant: Let me")]
    body = [torch.randint(3, len(tokenizer), (n,)).tolist() for n in (9, 6, 12)]
    responses = [body[0] + [eos], body[1], body[2] + [eos]]  # ends in EOS, not (length cap), EOS
    rollouts = [po.Rollout(str(i), i, None, p, 0, prefix={"rm": po.Prefix()}) for i, p in enumerate(prompts)]
    po.prefill("rm", rm, rollouts, 1.0, micro_batch_size=2)
    done = [0, 0, 0]
    while any(d < len(r) for d, r in zip(done, responses)):
        for i, r in enumerate(rollouts):
            done[i] = min(len(responses[i]), done[i] + 4)
            r.response = responses[i][:done[i]]
        po.prefill("rm", rm, rollouts, 1.0, micro_batch_size=2)
    ours = torch.stack([po.scored(r, "rm", rm) for r in rollouts])

    sequences = [p + r for p, r in zip(prompts, responses)]
    L = max(map(len, sequences))
    right = torch.full((3, L), pad)
    left = torch.full((3, L), pad)
    right_mask, left_mask = torch.zeros((3, L), dtype=torch.long), torch.zeros((3, L), dtype=torch.long)
    for i, seq in enumerate(sequences):
        right[i, :len(seq)], right_mask[i, :len(seq)] = torch.tensor(seq), 1
        left[i, L - len(seq):], left_mask[i, L - len(seq):] = torch.tensor(seq), 1
    with torch.no_grad():
        alone = torch.stack([rm(input_ids=torch.tensor([seq])).logits[0, 0] for seq in sequences])
        right_padded = rm(input_ids=right, attention_mask=right_mask).logits[:, 0]
        left_padded = rm(input_ids=left, attention_mask=left_mask).logits[:, 0]
        at_eos = torch.stack([rm.score(rm.model(input_ids=torch.tensor([seq])).last_hidden_state)[0, -1, 0]
                              for seq in sequences])
    torch.testing.assert_close(ours, alone, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, right_padded, atol=1e-4, rtol=0)
    torch.testing.assert_close(ours, left_padded, atol=1e-4, rtol=0)
    assert (alone[[0, 2]] - at_eos[[0, 2]]).abs().min() > 1e-3  # the EOS position really scores differently
    assert tasks.rm_position([5, 6, 0, 0], 0) == 1 and tasks.rm_position([0, 0], 0) == 0
    assert tasks.rm_position([5, 0], None) == 1


def test_trained_models_are_fp32_on_a_bf16_checkpoint(realistic_path):
    """The realistic checkpoint is bf16: actor, critic (its new value head too) and reference load
    in fp32 unless --dtype bfloat16 asks otherwise."""
    config = json.loads((Path(realistic_path) / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    policy, critic, ref, rm = common.load_networks(realistic_path, "cpu", torch.float32)
    assert rm is None
    for model in (policy, critic, ref):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    policy, critic, ref, _ = common.load_networks(realistic_path, "cpu", torch.bfloat16)
    for model in (policy, critic, ref):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_truncated_is_weights_and_weighted_policy_loss_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])  # the learner at the start of the round
    behaviour = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])  # the sampler's logprobs; the last token is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    weights, stats = po.truncated_is_weights(old, behaviour, mask, "token", cap=1.5)
    # exp(old - behaviour) = e^0.5 = 1.649 (truncated to 1.5), e^-1, e^0 = 1; padding 0
    torch.testing.assert_close(weights, torch.tensor([[1.5, math.exp(-1.0), 1.0, 0.0]]))
    assert stats["max_ratio"] == pytest.approx(math.exp(0.5))
    assert stats["truncated_fraction"] == pytest.approx(1 / 3)

    logp = old.clone().requires_grad_()  # first epoch: pi_theta = pi_old, ratio 1, nothing clipped
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    zeros = torch.zeros(1, 4)
    pg, _, _ = po.ppo_losses(logp, old, adv, zeros, zeros, zeros, mask, clip_coef=0.2, vf_clip=0.2, is_weights=weights)
    assert pg.item() == pytest.approx(-(1.5 * 1.0 + math.exp(-1.0) * -2.0 + 1.0 * 0.5) / 3)
    pg.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5 / 3, 2 * math.exp(-1.0) / 3, -0.5 / 3, 0.0]]))


def test_flags_take_the_paper_defaults_for_a_real_model_and_are_checked_where_declared():
    """--help and a run show the defaults of the model given: the tiny model's, or the paper's for a real one (the
    prompt budget included); each bad value stops in one line naming its flag, before anything starts."""
    tiny = checks.parse_args(po.Args, [], paper=po.PAPER)
    real = checks.parse_args(po.Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=po.PAPER)
    assert (tiny.num_rounds, tiny.batch_size, tiny.max_prompt_tokens, tiny.max_new_tokens) == (60, 64, 32, 32)
    assert (real.num_rounds, real.batch_size, real.max_prompt_tokens, real.max_new_tokens) == (1000, 112, 512, 1024)
    assert po.chunk_sizes(tiny) == (8, (4, 8, 16)) and po.chunk_sizes(real) == (256, (128, 256, 512))
    assert checks.parse_args(po.Args, ["--chunk-size", "2", "--chunk-tune-every", "0"]).chunk_size == 2
    for flags, flag in ((["--num-minibatches", "65"], "--num-minibatches"),
                        (["--delta", "20", "--delta-max", "16"], "--delta"),
                        (["--chunk-candidates", "1", "2", "3", "--chunk-tune-every", "3"], "--chunk-tune-every"),
                        (["--top-p", "0"], "--top-p"), (["--sampler-url", "http://host:8000"], "--sampler-url"),
                        (["--chunk-size", "2"], "--chunk-size")):  # (the tuner replaced it from round 0)
        with pytest.raises(SystemExit) as stop:
            checks.parse_args(po.Args, flags, paper=po.PAPER)
        assert str(stop.value.code).startswith(f"error: {flag}:") and "\n" not in str(stop.value.code), flags


@pytest.mark.slow
def test_nonfinite_loss_skips_every_step_and_is_logged(tmp_path, monkeypatch, tiny_path):
    """The real main() with a NaN policy loss: every optimizer step is skipped and counted in
    charts/nonfinite_skipped, the checkpoint holds the initial weights (finite), no version moves."""
    initial = {}

    def load_networks(*a, **k):
        models = real_load_networks(*a, **k)
        initial.update(policy=copy.deepcopy(models[0].state_dict()), critic=copy.deepcopy(models[1].state_dict()))
        return models

    def nan_losses(*a, **k):
        pg, vf, stats = real_losses(*a, **k)
        return pg * float("nan"), vf, stats

    real_load_networks, real_losses = common.load_networks, po.ppo_losses
    monkeypatch.setattr(common, "load_networks", load_networks)
    monkeypatch.setattr(po, "ppo_losses", nan_losses)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ppo_oppo.py", "--model", "tiny", "--exp-name", "nan", "--num-rounds", "2",
                                      "--batch-size", "4", "--num-ppo-epochs", "2", "--max-new-tokens", "8",
                                      "--eval-problems", "2", "--eval-samples", "1", "--chunk-tune-every", "0"])
    po.main()
    run, rows = _metrics(tmp_path, "nan")
    assert [r["charts/nonfinite_skipped"] for r in rows] == [2, 4]
    assert all(r["step"] == 0 for r in rows)
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    assert state["step"] == 0
    for part in ("policy", "critic"):
        for name, tensor in initial[part].items():
            assert torch.equal(state["model"][f"{part}.{name}"], tensor), name


def _run(tmp_path, *flags, expect_ok=True):
    cmd = [sys.executable, str(ROOT / "ppo_oppo.py"), "--model", "tiny", "--num-rounds", "4", "--batch-size", "8",
           "--eval-problems", "8", "--eval-samples", "2", "--micro-batch-size", "8", *flags]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    if expect_ok:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def _metrics(tmp_path, exp_name):
    [run] = (tmp_path / "runs").glob(f"{exp_name}__*")
    return run, [r for r in runlog.read_metrics(run) if "time/round_seconds" in r]


@pytest.mark.slow
def test_oppo_carries_sequences_over_and_resumes_them(tmp_path):
    """Long-tailed forced lengths and Delta = 8 on B = 8: the longest sequences are not done when
    B have finished, wait paused through the update, continue with the new weights and land in a
    later batch with tokens of two policy versions (their partial generation was kept)."""
    _run(tmp_path, "--exp-name", "oppo", "--long-tail", "0.5", "--long-tail-scale", "2", "--max-new-tokens", "64",
         "--delta", "8", "--delta-min", "8", "--num-rounds", "6", "--chunk-tune-every", "0")
    _, rows = _metrics(tmp_path, "oppo")
    assert len(rows) == 6
    assert sum(r["charts/carried_in_batch"] for r in rows) > 0
    assert sum(r["charts/resumed_in_batch"] for r in rows) > 0
    assert max(r["charts/batch_age_max"] for r in rows) >= 1 and max(r["charts/lag_max"] for r in rows) >= 1
    assert all(r["charts/delta"] == 8 for r in rows)
    assert all(r["time/score_hidden_seconds"] > 0 for r in rows)  # chunks were scored during generation
    # sequences of the current version: the sampler's logprobs are the learner's (fp32)
    assert max(r["charts/logprob_diff"] for r in rows) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--no-intra", "--no-inter"])
def test_each_ablation_runs(tmp_path, flag):
    """Each overlap alone. The --no-intra run also measures the joint clipping (issue 49, item 9; TRL's PPOTrainer
    clips neither): one clip_grad_norm_ over actor and critic, each round logging the fraction of its steps whose joint
    norm exceeded --max-grad-norm and the actor's share of the joint norm's square. At --max-grad-norm 1e-6 every step
    is clipped; the fresh score head's gradient takes a part."""
    clip = ["--max-grad-norm", "1e-6"] if flag == "--no-intra" else []
    out = _run(tmp_path, "--exp-name", "ablation", flag, *clip)
    label = "inter only" if flag == "--no-intra" else "intra only"
    assert f"| {label} |" in out.stdout
    _, rows = _metrics(tmp_path, "ablation")
    assert len(rows) == 4
    hidden = [r["time/score_hidden_seconds"] for r in rows]
    assert (min(hidden) > 0) if flag == "--no-inter" else (max(hidden) == 0)
    if clip:
        assert [r["losses/grad_clipped_fraction"] for r in rows] == [1.0] * 4
        assert all(0 < r["losses/actor_grad_share"] < 1 and r["losses/grad_norm"] > 1e-6 for r in rows), rows


@pytest.mark.slow
def test_reward_model_run_and_resume(tmp_path, tiny_reward_model):
    _run(tmp_path, "--exp-name", "rm", "--reward-model", tiny_reward_model, "--num-rounds", "2", "--save-every", "1")
    run, rows = _metrics(tmp_path, "rm")
    assert len(rows) == 2
    _run(tmp_path, "--reward-model", tiny_reward_model, "--num-rounds", "3", "--resume", str(run))
    rows = [r for r in runlog.read_metrics(run) if "time/round_seconds" in r]
    assert len(rows) == 3 and rows[-1]["step"] == 3 * 2  # round 3 of 2 epochs x 1 minibatch
    state = torch.load(run / "checkpoint.pt", weights_only=False)
    assert state["round"] == 3 and "critic.score.weight" in state["model"]


@pytest.mark.slow
def test_two_torchrun_ranks_train_as_one_process(tmp_path, tiny_reward_model):
    """The script under `torchrun --nproc-per-node 2` (FSDP2 over gloo) against one process with the
    same flags and seed: the same steps, losses and trained actor and critic (checkpoints in the same
    format); rank 0 alone writes the run. Synchronous PPO (--no-intra --no-inter): --intra is refused
    under torchrun, and with the inter-step overlap how far the carried sequences get before the
    pause depends on timing, so two runs would legitimately differ. The reward model and --tis on
    send the scoring and pi_old's forward through the ranks' shares too; --micro-batch-size 3 and
    --micro-batch-tokens 64 split the scoring, pi_old's forward and each minibatch's gradient into
    several micro-batches (the scoring: 3 groups of the 8 sequences, so rank 1 also runs a stand-in).
    (No torchrun resume here: test_distributed.py covers the checkpoints both ways.)"""
    from safetensors.torch import load_file

    flags = ["--model", "tiny", "--no-intra", "--no-inter", "--batch-size", "8", "--max-new-tokens", "16",
             "--micro-batch-size", "3", "--micro-batch-tokens", "64",
             "--reward-model", tiny_reward_model, "--tis", "on", "--eval-problems", "4", "--eval-samples", "1",
             "--seed", "3"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    runs = {}
    for name, launcher in (("two", torchrun), ("one", [sys.executable])):
        cwd = tmp_path / name
        cwd.mkdir()
        out = subprocess.run([*launcher, str(ROOT / "ppo_oppo.py"), *flags, "--num-rounds", "2"], cwd=cwd,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        runs[name] = cwd / out.stdout.split("run directory: ")[1].split()[0]
    assert len(list(runs["two"].parent.iterdir())) == 1  # only rank 0 writes a run directory
    rows = {k: [r for r in runlog.read_metrics(d) if "time/round_seconds" in r] for k, d in runs.items()}
    assert [r["step"] for r in rows["two"]] == [r["step"] for r in rows["one"]] == [2, 4]  # 2 epochs x 1 minibatch
    for key in ("charts/reward", "charts/kl", "charts/explained_variance", "charts/tis_max_ratio", "losses/policy",
                "losses/value", "losses/approx_kl", "losses/entropy", "losses/grad_norm"):
        assert [r[key] for r in rows["two"]] == pytest.approx([r[key] for r in rows["one"]], rel=1e-4, abs=1e-6), key
    assert all(r["charts/logprob_diff"] < 1e-4 for r in rows["two"])  # rank 0 pushed the gathered weights
    two, one = (load_file(d / "model" / "model.safetensors") for d in (runs["two"], runs["one"]))
    assert max((two[k] - one[k]).abs().max().item() for k in one) < 1e-5
    two, one = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (runs["two"], runs["one"]))
    assert sorted(two) == sorted(one)
    assert max((two["model"][k] - one["model"][k]).abs().max().item() for k in one["model"]) < 1e-5


@pytest.mark.slow
def test_bad_flags_and_reward_model_path_fail_with_one_line(tmp_path, error_before_start):
    assert "--delta" in error_before_start(po, "--model", "tiny", "--delta", "20", "--delta-max", "16")
    assert "context" in error_before_start(po, "--model", "tiny", "--max-new-tokens", "500")
    missing = str(tmp_path / "missing")  # refused before the sampler starts, and on the command line in one line
    assert error_before_start(po, "--model", "tiny", "--reward-model", missing).startswith("error: --reward-model")
    assert error_before_start(po, "--model", "tiny", "--critic-model", missing).startswith("error: --critic-model")
    out = _run(tmp_path, "--reward-model", missing, expect_ok=False)
    assert out.returncode != 0 and out.stderr.strip().splitlines()[-1].startswith("error: --reward-model")


PLAIN = ("--no-intra", "--no-inter", "--num-rounds", "3", "--max-new-tokens", "24", "--micro-batch-size", "2",
         "--num-minibatches", "2", "--chunk-tune-every", "0", "--eval-problems", "4", "--eval-samples", "1")


@pytest.fixture(scope="module")
def plain_ppo(tmp_path_factory):
    """Plain PPO, 3 rounds, a checkpoint kept after each: the run OPPO at Delta 0 is compared with (engine seeds) and
    the one resumed. Its tests share an xdist group, so that one worker runs it once."""
    cwd = tmp_path_factory.mktemp("plain_ppo")
    out = _run(cwd, "--exp-name", "plain", *PLAIN, "--save-every", "1", "--keep-checkpoints", "3")
    return (*_metrics(cwd, "plain"), out.stdout)


@pytest.mark.slow
@pytest.mark.xdist_group("plain_ppo")
@pytest.mark.parametrize("seeds", [(), ("--request-seeds",)], ids=["engine-seed", "request-seeds"])
def test_zero_staleness_oppo_reproduces_plain_ppo(tmp_path, seeds, request):
    """OPPO with Delta = 0 (nothing over-committed, nothing carried over) and intra-step streaming
    on is plain PPO computed in another order: the same sampled tokens (per-request seeds), the same
    rewards, and losses equal to float tolerance (chunked prefill vs one forward)."""
    oppo_flags = tuple(f for f in PLAIN if f not in ("--no-intra", "--no-inter"))
    # --delta 0 pins Delta (the controller, here asked to move it every round, leaves it at 0)
    _run(tmp_path, "--exp-name", "oppo0", "--delta", "0", "--delta-window", "1", "--chunk-size", "4", *oppo_flags,
         *seeds)
    if seeds:
        stdout = _run(tmp_path, "--exp-name", "plain", *PLAIN, *seeds).stdout
        plain_run, plain = _metrics(tmp_path, "plain")
    else:
        plain_run, plain, stdout = request.getfixturevalue("plain_ppo")
    oppo_run, oppo = _metrics(tmp_path, "oppo0")
    assert len(oppo) == len(plain) == 3
    assert all(r["time/score_hidden_seconds"] > 0 for r in oppo)  # it really streamed
    assert all(r["charts/delta"] == 0 for r in oppo)
    # plain PPO: no carry-over, nothing scored during generation, and its name in the summary
    assert all(r["charts/carried_in_batch"] == 0 and r["charts/lag_max"] == 0 and r["time/score_hidden_seconds"] == 0
               for r in plain)
    assert "| plain PPO |" in stdout
    for a, b in zip(oppo, plain):
        assert a["step"] == b["step"]
        for key in ("charts/reward", "charts/accuracy", "charts/response_length", "charts/no_eos_fraction"):
            assert a[key] == b[key], key  # the same tokens
        for key in ("charts/kl", "losses/policy", "losses/value", "losses/entropy", "losses/approx_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), key
    final = [torch.load(run / "checkpoint.pt", weights_only=True)["model"] for run in (oppo_run, plain_run)]
    for name, tensor in final[0].items():
        torch.testing.assert_close(tensor, final[1][name], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.xdist_group("plain_ppo")
def test_plain_ppo_resume_is_exact(tmp_path, plain_ppo):
    """Plain PPO resumed from its checkpoint after round 1 (written mid-run: --save-every 1) gives the uninterrupted
    run's rounds 2 and 3, row for row (the checkpoint keeps the sampler's generators and the learner's RNG).
    charts/reward is the task's score; charts/reward_penalized, what PPO trains on, less the missing-EOS penalty."""
    straight, rows, _ = plain_ppo
    run = tmp_path / "runs" / straight.name  # a copy: the resumed run goes on in the checkpoint's directory
    shutil.copytree(straight, run)
    first = min(run.glob("checkpoints/*.pt"), key=lambda p: int(p.stem))
    _run(tmp_path, "--resume", str(first), *PLAIN)
    timing = lambda k: k.startswith(("time/", "memory/")) or k in ("wall",) or "per_second" in k  # noqa: E731
    again = [{k: v for k, v in r.items() if not timing(k)} for r in _metrics(tmp_path, "plain")[1]]
    assert len(rows) == 3 and len(again) == 3  # the copy's rows after the checkpoint: replaced by the resumed run's
    assert [{k: v for k, v in r.items() if not timing(k)} for r in rows][1:] == again[1:]
    for r in rows:  # --missing-eos-penalty 1.0 on every response without EOS
        assert r["charts/reward_penalized"] == pytest.approx(r["charts/reward"] - r["charts/no_eos_fraction"])


def test_chat_template_flag_needs_a_template(error_before_start):
    message = error_before_start(po, "--model", "tiny", "--chat-template")  # the tiny tokenizer has none
    assert message.startswith("error: --chat-template"), message


def _run_realistic(tmp_path, realistic_path, exp_name, *flags, bf16_sampler: bool = False):
    """The realistic model with the script's non-tiny (paper) defaults, temperature 0.7 included,
    top-p 0.95; only sizes and counts shrunk. `bf16_sampler`: --sampler-dtype bfloat16 (a GPU's
    default precision split)."""
    flags = (*flags, "--sampler-dtype", "bfloat16") if bf16_sampler else flags
    cmd = [sys.executable, str(ROOT / "ppo_oppo.py"), "--model", realistic_path, "--exp-name", exp_name, "--top-p",
           "0.95", "--num-rounds", "2", "--batch-size", "4", "--max-new-tokens", "16", "--eval-problems", "2",
           "--eval-samples", "1", *flags]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    run, rows = _metrics(tmp_path, exp_name)
    assert len(rows) == 2
    args = json.loads((run / "args.json").read_text())
    assert args["temperature"] == 0.7 and args["top_p"] == 0.95 and args["delta"] == 8 and args["num_ppo_epochs"] == 4
    diffs = [r["charts/logprob_diff"] for r in rows if not math.isnan(r["charts/logprob_diff"])]
    if bf16_sampler:
        assert diffs and min(diffs) > 1e-4, diffs  # the split is real: a bf16 sampler against the fp32 learner
    else:
        assert diffs and max(diffs) <= 1e-4, diffs  # the logprob contract holds under top-p on a bf16 checkpoint
    assert all(r["charts/nonfinite_skipped"] == 0 for r in rows)
    return out, rows


@pytest.mark.slow
def test_realistic_model_end_to_end(tmp_path, realistic_path):
    _, rows = _run_realistic(tmp_path, realistic_path, "realistic")
    # fp32 on both sides: no mismatch correction by default, and the sampler's logprobs serve as pi_old
    assert not any("charts/tis_max_ratio" in r for r in rows)
    assert rows[0]["charts/first_ratio_deviation"] < 1e-4


@pytest.mark.slow
def test_realistic_model_chat_template_and_bf16_sampler_by_default(tmp_path, realistic_path):
    """The GPU's precision split, every other flag at its default: pi_old (the ratio's denominator and the
    KL-in-reward's policy term) is the learner's own recomputation, the sampler's bf16 logprobs enter only
    the truncated weights."""
    out, rows = _run_realistic(tmp_path, realistic_path, "realistic_tis", "--chat-template", bf16_sampler=True)
    assert "<|im_start|>user" in out.stdout and "<|im_start|>assistant" in out.stdout  # the printed sample prompt
    for r in rows:  # before the first step of every round, the ratio is 1: pi_old is the learner's
        assert r["charts/first_ratio_deviation"] < 1e-3
        # (a carried-over token's ratio also carries its staleness)
        assert 0.0 <= r["charts/tis_truncated_fraction"] <= 1.0
    assert rows[0]["charts/kl"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at round 0
    # nothing stale yet: the weight corrects the bf16 sampler's own numbers only, ratios near 1 but not 1
    assert rows[0]["charts/tis_max_ratio"] != pytest.approx(1.0, abs=1e-6) and rows[0]["charts/tis_max_ratio"] < 2.0


def test_learning_rate_decays_linearly_for_a_real_model_as_trl():
    """TRL's PPOTrainer (OPPO's base): a linear schedule to 0 over its batches, stepped once per batch; a real model
    gets it, the tiny model and --lr-schedule constant a constant rate."""
    real = checks.parse_args(po.Args, ["--model", "Qwen/Qwen2.5-0.5B"], paper=po.PAPER)
    assert (real.lr_schedule, checks.parse_args(po.Args, [], paper=po.PAPER).lr_schedule) == ("linear", "constant")
    constant = checks.parse_args(po.Args, ["--model", "Qwen/Qwen2.5-0.5B", "--lr-schedule", "constant"], paper=po.PAPER)
    assert constant.lr_schedule == "constant"
    assert po.scheduled_learning_rate is common.scheduled_learning_rate  # (tests/test_common.py)


def strip_ppo(source: str) -> str:
    """ppo_oppo.py as a student strips it to the method (tests/test_pages.py's test for rloo_kreuse.py): no checkpoints,
    snapshots or evaluation between rounds (the loop's after-round lines), no torchrun calls (the --intra and
    world-size checks, all_sum), and one metric besides the seconds."""
    lines = without_after_round(source).splitlines(keepends=True)
    for start, count in (("        run.from_main(checks.check_args", 3),
                         ("                loss, out = run.all_sum((loss, out))", 1)):
        at = next(i for i, line in enumerate(lines) if line.startswith(start))
        del lines[at:at + count]
    source = "".join(lines)
    source = strip_to_method(source, [],
                             '{"charts/reward": scores.mean().item(), "time/generate_seconds": generate_seconds, '
                             '"time/train_seconds": train_seconds}')
    assert all(gone not in source for gone in ("distributed.check_world_size", "run.save(", "run.all_sum((loss"))
    return source


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--no-intra", "--no-inter"), ("--delta", "4")], ids=["plain", "oppo"])
def test_a_copy_stripped_to_its_method_runs_pushes_and_stops(flags):
    """Issue 48: the copy's obligations are code. Plain PPO: each round after the first was sampled by the weights
    pushed after the one before (sampler.check_version in the copy stops it otherwise); OPPO: sequences
    over-committed and carried, and still a clean stop (the carried ones aborted, the sampler closed)."""
    out = run_stripped_copy("ppo_stripped", strip_ppo((ROOT / "ppo_oppo.py").read_text()),
                            ["--num-rounds", "3", "--batch-size", "4", "--num-ppo-epochs", "1", "--max-new-tokens",
                             "16", "--chunk-tune-every", "0", "--eval-problems", "4", "--eval-samples", "1", *flags],
                            "ppo_oppo")
    assert "round 3/3 step 3" in out.stdout and "reward" in out.stdout  # one step a round: 1 epoch x 1 minibatch
