"""distributed.py: the learner under torchrun (FSDP2 on gloo) takes the single-process step.

One scenario (`scenario` below) runs twice: in this process (one rank, no process group) and as
`torchrun --nproc-per-node 2 tests/test_distributed.py ...` (this file is the worker). It trains the
tiny model (tied embeddings) and a critic (the same backbone with a value head, as PPO's) through
common.token_logprobs (chunked head, activation-checkpointed chunks) and the backbone/score path,
with HF gradient checkpointing, fused AdamW and clipping, on global batches whose micro-batches split
unevenly over the ranks (one step with a single row: rank 1 only runs the stand-in). Then it gathers
the policy into an unsharded copy (the sampler's), writes a checkpoint, resumes the other side's
checkpoint and takes one more step. The tests compare the two runs' files."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import common  # noqa: E402
from fastrl import runlog, util  # noqa: E402
from fastrl import distributed  # noqa: E402

STEPS = (7, 1, 5)  # global batch sizes of the training steps; then one step of RESUMED_STEP after a resume
RESUMED_STEP = 6
MICRO_TOKENS = 24  # a small budget: several micro-batches per step, dealt unevenly to 2 ranks
TOL = 1e-5


# --------------------------------------------------------------------------------------
# The scenario (one process here, two under torchrun)
# --------------------------------------------------------------------------------------


def _models(tiny_path: str, d: distributed.Dist):
    """Policy (tiny, tied embeddings), critic (its backbone + a value head) as a PPO learner, the
    sampler's copy, fused AdamW over both; sharded under torchrun."""
    from transformers import AutoModelForSequenceClassification

    policy = common.load_policy(tiny_path, d.device)
    policy.gradient_checkpointing_enable()
    policy.train()
    critic = util.load_hf(AutoModelForSequenceClassification, tiny_path, quiet=True, num_labels=1).to(d.device)
    with torch.no_grad():  # the value head, the same everywhere
        critic.score.weight.copy_(torch.randn(critic.score.weight.shape,
                                              generator=torch.Generator().manual_seed(3)) * 0.05)
    push_model = distributed.push_copy(policy, d)
    distributed.shard(policy, d)
    distributed.shard(critic, d)
    learner = torch.nn.ModuleDict(dict(policy=policy, critic=critic))
    optimizer = torch.optim.AdamW(learner.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01, fused=True)
    return learner, push_model, optimizer


def _batch(n: int, seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    completions = [torch.randint(3, vocab, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    advantages = torch.randn(n, generator=g)
    returns = torch.randn(n, generator=g)
    return prompts, completions, advantages, returns


@contextlib.contextmanager
def _chunked_head():
    """common.token_logprobs' memory-saving path (backbone, then lm_head per chunk) also for FSDP
    modules, which common may send through the root's forward instead: shard() supports both."""

    original = common._backbone_and_head
    common._backbone_and_head = lambda model: (model.get_decoder(), model.get_output_embeddings())
    try:
        yield
    finally:
        common._backbone_and_head = original


def _train_step(learner, optimizer, n: int, seed: int, d: distributed.Dist) -> dict:
    """One optimizer step on a global batch of n rows, written as the scripts write it (each rank on its
    micro-batches of common.micro_batch_plan, each loss backpropagated with its share, summed over ranks, one
    clipped step): a policy-gradient term (token_logprobs) and a value loss (critic backbone + score), both
    normalised by the GLOBAL number of completion tokens."""

    policy, critic = learner["policy"], learner["critic"]
    prompts, completions, advantages, returns = _batch(n, seed, policy.config.vocab_size)
    ids, attn, cmask = (t.to(d.device) for t in common.pad_prompt_completions(prompts, completions, 0))
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    mask = cmask[:, 1:].float()
    global_tokens = mask.sum()
    micro = common.micro_batch_plan(lengths, MICRO_TOKENS, dist=d)  # this rank's share of the global plan

    def loss_fn(mb):  # the micro-batch's mean over its tokens, weighed below by its share of the global tokens
        rows, width = mb.items, mb.width
        x, a, c, m = ids[rows, :width], attn[rows, :width], cmask[rows, :width], mask[rows, :width - 1]
        with _chunked_head():  # the backbone, then the head per chunk (~3 positions), checkpointed
            logp = common.token_logprobs(policy, x, a, c, temperature=0.9, chunk_bytes=4 * policy.config.vocab_size * 3)
        # and the root's own forward, in the same backward
        logits = policy(input_ids=x, attention_mask=a).logits[:, :-1]
        values = critic.score(
            critic.base_model(input_ids=x, attention_mask=a).last_hidden_state[:, :-1]).squeeze(-1) * m
        pg = -(advantages[rows].to(d.device)[:, None] * logp).sum() + 0.01 * (logits.logsumexp(-1) * m).sum()
        vf = 0.5 * ((values - returns[rows].to(d.device)[:, None]) ** 2 * m).sum()
        tokens = m.sum().item()
        return (pg + vf) / tokens, tokens, {}

    loss = 0.0
    for mb in micro:
        mb_loss, tokens, _ = loss_fn(mb)
        share = mb.weight * tokens / global_tokens.item()  # (weight 0: a stand-in)
        (mb_loss * share).backward()
        loss = loss + mb_loss.detach() * share
    loss = distributed.all_sum(loss, d)
    grad_norm = torch.nn.utils.clip_grad_norm_(learner.parameters(), 1.0)  # (a DTensor under torchrun: replicated)
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm))
    optimizer.step()
    optimizer.zero_grad()
    return dict(loss=float(loss), grad_norm=grad_norm.item(), micro=len(micro),
                stand_ins=distributed.all_sum(sum(mb.weight == 0 for mb in micro), d))  # over all ranks


def scenario(tiny_path: str, out: Path, other_checkpoint: Path | None, d: distributed.Dist) -> None:
    """Train len(STEPS) steps and write out/: log.json, push.pt (the sampler's copy, rank 0),
    checkpoint.pt (distributed.save_checkpoint); with other_checkpoint (the other run's), resume it
    into fresh models: resumed.pt (state_for_checkpoint right after loading) and, after one more step,
    after.pt."""
    torch.manual_seed(0)
    learner, push_model, optimizer = _models(tiny_path, d)
    log = [_train_step(learner, optimizer, n, seed, d) for seed, n in enumerate(STEPS)]
    distributed.gather_into(learner["policy"], push_model, d)
    if d.is_main:
        torch.save(push_model.state_dict(), out / "push.pt")
        (out / "log.json").write_text(json.dumps(log))
    runlog.save_checkpoint(out / "checkpoint.pt", learner, optimizer, step=len(STEPS), data_position=sum(STEPS), dist=d,
                                round=len(STEPS))
    if other_checkpoint is None:
        return
    learner, push_model, optimizer = _models(tiny_path, d)
    state = runlog.load_checkpoint(other_checkpoint, learner, optimizer, dist=d, required=("round",))
    saved = distributed.state_for_checkpoint(learner, optimizer, d)
    if d.is_main:
        torch.save({**saved, "scalars": {k: state[k] for k in ("step", "data_position", "round")}}, out / "resumed.pt")
    _train_step(learner, optimizer, RESUMED_STEP, 99, d)
    saved = distributed.state_for_checkpoint(learner, optimizer, d)
    if d.is_main:
        torch.save(saved, out / "after.pt")
    try:  # a bad --resume: one line on rank 0, every rank stops (none waits in a collective)
        runlog.load_checkpoint(out / "missing.pt", learner, optimizer, dist=d)
        outcome = "loaded"
    except SystemExit as e:
        outcome = e.code
    (out / f"error_rank{d.rank}.json").write_text(json.dumps(outcome))


def worker() -> None:
    """torchrun's entry: tests/test_distributed.py TINY_PATH OUT_DIR OTHER_CHECKPOINT."""
    d = distributed.init(timeout_s=120)
    try:
        scenario(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), d)
    finally:
        distributed.close(d)


# --------------------------------------------------------------------------------------
# Two ranks against one process
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tiny_path, tmp_path_factory):
    """The scenario in this process (one rank), then under torchrun with 2 gloo ranks, each resuming
    the other's checkpoint: (one_dir, two_dir, seconds of the torchrun run)."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scenario(tiny_path, one, None, distributed.Dist())  # first: the 2-rank run resumes its checkpoint
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-addr", "127.0.0.1",
                                 "--master-port", str(_free_port()), str(Path(__file__)), tiny_path, str(two),
                                 str(one / "checkpoint.pt")],
                                cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        seconds = time.perf_counter() - start
        assert result.returncode == 0, result.stderr[-3000:]
        # and one process resumes the 2-rank checkpoint (the other direction), then takes the same step
        learner, _, optimizer = _models(tiny_path, distributed.Dist())
        state = runlog.load_checkpoint(two / "checkpoint.pt", learner, optimizer, dist=distributed.Dist(),
                                       required=("round",))
        assert (state["step"], state["data_position"], state["round"]) == (len(STEPS), sum(STEPS), len(STEPS))
        torch.save(distributed.state_for_checkpoint(learner, optimizer, distributed.Dist()), one / "resumed.pt")
        _train_step(learner, optimizer, RESUMED_STEP, 99, distributed.Dist())
        torch.save(distributed.state_for_checkpoint(learner, optimizer, distributed.Dist()), one / "after.pt")
    finally:
        torch.set_num_threads(threads)
    return one, two, seconds


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _assert_states_equal(a: dict, b: dict, tol: float = TOL) -> None:
    """Model state dicts, or {"model", "optimizer"} in optimizer.state_dict()'s format (keyed by index)."""
    if "model" in a:
        _assert_states_equal(a["model"], b["model"], tol)
        oa, ob = a["optimizer"], b["optimizer"]
        assert ([{k: v for k, v in g.items()} for g in oa["param_groups"]]
                == [{k: v for k, v in g.items()} for g in ob["param_groups"]])
        assert sorted(oa["state"]) == sorted(ob["state"]) and all(isinstance(k, int) for k in oa["state"])
        for i in oa["state"]:
            assert sorted(oa["state"][i]) == sorted(ob["state"][i])
            for key, value in oa["state"][i].items():
                other = ob["state"][i][key]
                assert value.shape == other.shape, (i, key)
                torch.testing.assert_close(value.float().cpu(), other.float().cpu(), atol=tol, rtol=0,
                                           msg=f"optimizer {i} {key}")
        return
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        torch.testing.assert_close(a[name].float().cpu(), b[name].float().cpu(), atol=tol, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.xdist_group("two_rank_runs")
def test_two_ranks_take_the_single_process_steps(runs):
    one, two, seconds = runs
    print(f"torchrun, 2 ranks: {seconds:.1f} s")
    log_one, log_two = json.loads((one / "log.json").read_text()), json.loads((two / "log.json").read_text())
    assert [s["stand_ins"] for s in log_one] == [0, 0, 0]
    # uneven steps, a 1-row step
    assert [s["stand_ins"] for s in log_two][1] == 1 and sum(s["stand_ins"] for s in log_two) >= 2
    for a, b in zip(log_one, log_two):
        assert (abs(a["loss"] - b["loss"]) < TOL
                and abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"]))
    assert all(s["grad_norm"] > 1.0 for s in log_one)  # clipping was active: the global norm, not a rank's, was used
    _assert_states_equal(_load(one / "checkpoint.pt")["model"], _load(two / "checkpoint.pt")["model"])


@pytest.mark.slow
@pytest.mark.xdist_group("two_rank_runs")
def test_gather_into_gives_rank0_the_full_model(runs):
    one, two, _ = runs
    pushed = _load(two / "push.pt")
    single = {k.removeprefix("policy."): v for k,
              v in _load(one / "checkpoint.pt")["model"].items() if k.startswith("policy.")}
    _assert_states_equal(pushed, single)
    assert pushed["lm_head.weight"].data_ptr() == pushed["model.embed_tokens.weight"].data_ptr()  # still tied


@pytest.mark.slow
@pytest.mark.xdist_group("two_rank_runs")
def test_checkpoints_are_the_single_process_format_both_ways(runs):
    one, two, _ = runs
    first, second = _load(one / "checkpoint.pt"), _load(two / "checkpoint.pt")
    assert sorted(first) == sorted(second) and second["step"] == len(STEPS) and second["round"] == len(STEPS)
    _assert_states_equal({k: first[k] for k in ("model", "optimizer")}, {k: second[k] for k in ("model", "optimizer")})
    # 1 -> 2: the 2-rank run loaded the single-process checkpoint; 2 -> 1: this process loaded the 2-rank one
    resumed_two, resumed_one = _load(two / "resumed.pt"), _load(one / "resumed.pt")
    assert resumed_two["scalars"] == {"step": len(STEPS), "data_position": sum(STEPS), "round": len(STEPS)}
    _assert_states_equal({k: first[k] for k in ("model", "optimizer")},
                         {k: resumed_two[k] for k in ("model", "optimizer")}, tol=0.0)
    _assert_states_equal({k: second[k] for k in ("model", "optimizer")}, resumed_one, tol=0.0)
    # and both go on to take the same step from there
    _assert_states_equal(_load(one / "after.pt"), _load(two / "after.pt"))


@pytest.mark.slow
@pytest.mark.xdist_group("two_rank_runs")
def test_a_bad_resume_stops_every_rank_with_one_line(runs):
    _, two, _ = runs
    codes = [json.loads((two / f"error_rank{r}.json").read_text()) for r in range(2)]
    assert codes[0].startswith("error: --resume: no checkpoint at") and "\n" not in codes[0]
    assert codes[1] == 1  # quiet: the line is rank 0's


# --------------------------------------------------------------------------------------
# Without processes: shares, the single-process identity
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 5, 7, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shares_cover_every_item_once_contiguously(n, world):
    shares = [distributed.my_share(range(n), distributed.Dist(rank, world)) for rank in range(world)]
    assert sum(shares, []) == list(range(n))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert all(len(s) == 0 for s in shares[n:])  # more ranks than items: the last ones get nothing


@pytest.mark.parametrize("world", [2, 3])
def test_micro_batches_same_count_on_every_rank(world):
    lengths = [5, 9, 3, 12, 7, 4, 11]
    plan = common.micro_batches(lengths, 20)
    per_rank = [distributed.my_micro_batches(plan, distributed.Dist(rank, world)) for rank in range(world)]
    assert len({len(m) for m in per_rank}) == 1
    real = sorted(tuple(rows) for m in per_rank for rows, w in m if w == 1.0)
    assert real == sorted(tuple(rows) for rows in plan)  # each micro-batch exactly once, at weight 1
    stand_ins = [rows for m in per_rank for rows, w in m if w == 0.0]
    assert len(stand_ins) == world * len(per_rank[0]) - len(plan)
    assert all(rows == [lengths.index(min(lengths))] for rows in stand_ins)  # the cheapest row
    assert distributed.my_micro_batches(plan, distributed.Dist()) == [(rows, 1.0) for rows in plan]


def test_one_process_is_the_plain_learner(tiny_path):
    d = distributed.Dist()
    assert distributed.init() == d and not d.enabled and d.is_main  # no torchrun: no process group
    assert not torch.distributed.is_initialized()
    model = common.load_policy(tiny_path, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert distributed.shard(model, d) is model and type(model).__name__ == "Qwen2ForCausalLM"
    assert distributed.push_copy(model, d) is model
    distributed.gather_into(model, model, d)
    ids = torch.tensor([[5, 6, 7, 8]])
    common.token_logprobs(model, ids, torch.ones_like(ids), torch.tensor([[0, 0, 1, 1]])).sum().backward()
    optimizer.step()
    state = distributed.state_for_checkpoint(model, optimizer, d)
    assert state["optimizer"] == optimizer.state_dict() and state["model"].keys() == model.state_dict().keys()
    assert distributed.all_sum(3.5, d) == 3.5 and distributed.all_mean({"a": 2}, d) == {"a": 2}
    assert distributed.broadcast([1, 2], d) == [1, 2] and distributed.from_main(lambda: 7, d) == 7
    distributed.close(d)


def test_close_waits_until_no_other_thread_runs():
    """A rank's last collective is freed on gloo's worker thread after wait() returned, and the free may take
    the GIL, which Python never gives back once it is shutting down (the process aborts;
    distributed.wait_for_quiet_threads). So a rank's close() returns only when no other thread runs: here a
    thread in GIL-free torch work, then taking the GIL again to record that it finished, stands for that worker."""
    import threading

    a, finished = torch.randn(600, 600), []

    def work():
        for _ in range(20):
            a @ a  # the GIL released, as gloo's worker runs without it
        finished.append(True)  # and then takes it

    worker = threading.Thread(target=work)
    worker.start()
    assert distributed.wait_for_quiet_threads(timeout_s=120)
    assert finished == [True]
    worker.join()
    # a thread that runs on past the timeout: False, not a hang
    longer = threading.Thread(target=lambda: [a @ a for _ in range(60)])
    longer.start()
    assert distributed.wait_for_quiet_threads(timeout_s=0.05) is False
    longer.join()


def test_too_many_processes_is_one_line():
    distributed.check_world_size(4, "episodes per round", distributed.Dist(0, 4))
    with pytest.raises(SystemExit) as main:
        distributed.check_world_size(3, "episodes per round", distributed.Dist(0, 4))
    assert main.value.code == ("error: torchrun --nproc-per-node 4: more processes than episodes per round (3); "
                               "use at most 3 processes or a larger batch")
    with pytest.raises(SystemExit) as other:
        distributed.check_world_size(3, "episodes per round", distributed.Dist(2, 4))
    assert other.value.code == 1


if __name__ == "__main__":
    worker()
