"""What real training scripts do around the optimizer, on real processes: several optimizers in
one process, a GAN's loop, a skipped step, a backward pass that raises, a peer that dies during
backward. Each must leave every rank with the same bits (or fail loudly), never silently
different parameters."""
import pytest
import torch


def run(run_workers, case, *args, world=2, check=True, env=None):
    job = run_workers("coordination.py", "--case", case, *args, world=world, env=env)
    if check:
        job.check()
    return job


def assert_ranks_agree(job, keys):
    steps = job.loads("steps")
    for step, per_rank in enumerate(zip(*steps)):
        for key in keys:
            first = per_rank[0][key]
            for rank, rec in enumerate(per_rank[1:], 1):
                assert rec[key] == first, f"step {step}: rank {rank}'s {key} differ from rank 0's"
    return steps


@pytest.mark.parametrize("compression", ["none", "topk:ratio=0.01|ef"])
def test_two_optimizers_in_one_process_agree(run_workers, compression):
    two = run(run_workers, "two_optimizers", "--compression", compression, "--steps", 6)
    steps = assert_ranks_agree(two, ["a", "b"])
    if compression == "none":
        # Uncompressed, each optimizer's exchange is the exact mean (W = 2): the same bits as
        # one optimizer over both models.
        one = run(run_workers, "one_optimizer", "--steps", 6).loads("steps")
        for step, (got, want) in enumerate(zip(steps[0], one[0])):
            assert got == want, f"step {step}: two optimizers differ from one over both models"


def test_collectives_of_the_model_during_backward_keep_ranks_together(run_workers):
    """Layers that allreduce on the default group in backward (SyncBatchNorm's pattern) while
    the optimizer exchanges: over that same group the ranks saw the two interleaved in different
    orders and Gloo aborted the job; the optimizer now exchanges over a group of its own.
    (Whatever the codec: uncompressed, the result can be checked exactly.)"""
    job = run(run_workers, "collectives_in_backward", "--steps", 5)
    steps = assert_ranks_agree(job, ["params", "reference"])
    # Uncompressed the exchange is the exact mean (W = 2), as averaged by hand.
    for step, rec in enumerate(steps[0]):
        assert rec["params"] == rec["reference"], f"step {step}: differs from the reference"


def test_a_channels_last_model_is_broadcast_and_averaged_exactly(run_workers):
    """channels_last weights are not contiguous: the construction's broadcast refused them
    ("only dense contiguous CPU tensors"), so such a model could not be wrapped."""
    job = run(run_workers, "channels_last", "--steps", 3)
    steps = assert_ranks_agree(job, ["params", "reference"])
    for step, rec in enumerate(steps[0]):
        assert rec["params"] == rec["reference"], f"step {step}: differs from the reference"
        assert rec["channels_last"], f"step {step}: the weights lost their memory format"


def test_a_parameter_unfrozen_after_construction_is_refused(run_workers):
    """Fine-tuning's unfreezing: the layer left out when the optimizer was built would have been
    stepped on each rank's own gradient, the ranks drifting apart silently. step() refuses,
    naming it, before anything moves; an optimizer built again takes it in."""
    job = run(run_workers, "unfreeze", "--compression", "topk:ratio=0.05|ef", "--steps", 5)
    steps = assert_ranks_agree(job, ["params"])
    for per_rank in steps:
        errors = [rec.get("error") for rec in per_rank]
        assert errors == [None, None, errors[2], None, None]
        assert "parameter '0.weight' has a gradient" in errors[2], errors[2]
        assert not per_rank[2]["moved"]
    assert steps[0][3]["params"] != steps[0][2]["params"]  # the new optimizer steps the layer


def test_a_parameter_group_added_after_construction_is_refused(run_workers):
    """Fine-tuning's add_param_group on the wrapped optimizer: the layer added would have been
    stepped on each rank's own gradient. step() refuses, naming it, before anything moves; a
    DistributedOptimizer built again around the same SGD takes it in and replaces the old one,
    even while an LR scheduler still holds the old wrapper (both exchanged every gradient,
    their engines writing the same .grad at once), and the model trains as the same model
    whose old wrapper is gone."""
    job = run(run_workers, "add_group", "--compression", "topk:ratio=0.05|ef", "--steps", 5)
    steps = assert_ranks_agree(job, ["params0", "params1"])
    for per_rank in steps:
        for i in (0, 1):
            errors = [rec.get(f"error{i}") for rec in per_rank]
            assert errors[:2] == [None, None] and errors[3:] == [None, None], errors
            assert "holds parameter '0.weight', which it did not hold" in errors[2], errors[2]
            assert not per_rank[2][f"moved{i}"]
        for step, rec in enumerate(per_rank):
            assert rec["params0"] == rec["params1"], f"step {step}: the kept wrapper changed it"
        assert "took this one's place" in per_rank[-1]["replaced"]
    assert steps[0][3]["params0"] != steps[0][2]["params0"]  # the new optimizer steps on


def test_a_ddp_model_is_not_averaged_twice(run_workers):
    """DDP averages every gradient itself, uncompressed: DistributedOptimizer on top would pay
    for that allreduce and its own. The DDP model itself is refused; its named_parameters()
    ("module." names) warn, pointing at the script's line."""
    job = run(run_workers, "ddp_twice")
    for (record,) in job.loads("steps"):
        assert "named_parameters is a DistributedDataParallel model" in record["error"]
        assert "register_comm_hook" in record["error"]
        ddp = [w for w in record["warnings"] if "begins with 'module.'" in w]
        assert len(ddp) == 1, record["warnings"]
        assert record["warned_at"][record["warnings"].index(ddp[0])].endswith("coordination.py")


def test_optimizers_over_the_scripts_own_groups(run_workers):
    """Data-parallel groups made by the script (2 x 2 ranks), each optimizer built by its
    group's members only, over that group as it is (a new group would need every rank of the
    job); a second optimizer over the same group is refused, as two would interleave."""
    job = run(run_workers, "subgroups", "--steps", 3, world=4)
    steps = job.loads("steps")
    for step in range(3):
        params = [steps[r][step]["params"] for r in range(4)]
        assert params[0] == params[1] and params[2] == params[3], f"step {step}"
        assert params[0] != params[2], f"step {step}: the groups have other data"
    for r in range(4):
        assert "already carries another gradcomp optimizer's exchange" in steps[r][-1]["second"]
        assert "state is a process group of 2 ranks, but the hook exchanges over 4" in (
            steps[r][-1]["hook"])
    grads = [steps[r][-1]["hook_grads"] for r in range(4)]
    assert grads[0] == grads[1] and grads[2] == grads[3] and grads[0] != grads[2]


def test_gan_loop_runs_and_agrees(run_workers):
    """DCGAN's loop with only its optimizers wrapped. (What two backward passes before step()
    exchange is asserted exactly in test_bad_input's backward_twice case.)"""
    job = run(run_workers, "gan", "--steps", 4)
    steps = assert_ranks_agree(job, ["g", "d"])
    for step in range(4):
        for i, (a, b) in enumerate(zip(steps[0][step]["d_grads"], steps[1][step]["d_grads"])):
            assert torch.equal(a, b), f"step {step}: discriminator gradient {i} differs"


def test_synchronize_then_skipped_step_keeps_ranks_together(run_workers):
    job = run(run_workers, "skip_step", "--steps", 5, "--compression", "topk:ratio=0.01|ef")
    steps = assert_ranks_agree(job, ["params"])
    # Step 1 was skipped: the parameters did not move; the others did.
    assert steps[0][1]["params"] == steps[0][0]["params"]
    assert steps[0][2]["params"] != steps[0][1]["params"]


@pytest.mark.parametrize("who", ["0", "0,1"])
def test_backward_raising_is_never_silent(run_workers, who):
    job = run(run_workers, "backward_raises", "--who", who, "--steps", 4,
              "--compression", "topk:ratio=0.01|ef")
    steps = job.loads("steps")
    raisers = {int(r) for r in who.split(",")}
    for rank in range(2):
        outcome = steps[rank][1]["outcome"]
        if rank in raisers:
            assert outcome.startswith("raised: boom"), outcome
        else:
            # The exchange of the failed pass was completed with NaN: this rank sees it.
            assert outcome == "non-finite", outcome
    # Before and after, every rank holds the same parameters.
    assert_ranks_agree(job, ["params"])
    assert all(s["outcome"] == "stepped" for s in steps[0][2:])


@pytest.mark.parametrize("who", ["0", "0,1"])
def test_a_loop_clearing_with_model_zero_grad_after_a_raising_backward(run_workers, who):
    """The loop clears gradients with model.zero_grad(), which gradcomp does not see: the next
    backward pass completes the exchange the raising pass left (NaN) from its first gradient,
    then runs its own. Gradients the raising pass had handed over must not read as a second
    pass running at the same time."""
    job = run(run_workers, "backward_raises", "--who", who, "--steps", 4,
              "--model-zero-grad", 1, "--compression", "topk:ratio=0.01|ef")
    steps = job.loads("steps")
    raisers = {int(r) for r in who.split(",")}
    for rank in range(2):
        assert steps[rank][1]["outcome"].startswith("raised: boom" if rank in raisers
                                                    else "non-finite"), steps[rank][1]
        assert all(s["outcome"] == "stepped" for s in steps[rank][2:]), steps[rank]
    assert_ranks_agree(job, ["params"])


def test_a_peer_lost_before_a_raised_pass_is_completed_is_a_comm_error(run_workers):
    """Rank 1 is gone when rank 0's next pass completes the exchange its raising pass left:
    the failure comes from autograd's hook, and must reach backward()'s caller as
    gradcomp.CommError, not as a bare RuntimeError."""
    job = run(run_workers, "backward_raises", "--who", "0", "--steps", 4, "--peer-dies", 1,
              "--model-zero-grad", 1, "--compression", "topk:ratio=0.01|ef", check=False,
              env={"GRADCOMP_TIMEOUT": "2"})
    assert job.returncode == 0, job.describe()
    steps = job.load("steps", 0)
    assert steps[1]["outcome"].startswith("raised: boom"), steps[1]
    assert steps[-1]["outcome"].startswith("comm error: gradcomp"), steps[-1]
    assert len(steps) == 3, steps


def test_a_plain_loop_after_a_raising_backward_keeps_ranks_together(run_workers):
    """A try/except loop that calls step() whenever backward returned: on rank 1 the mean of
    the step rank 0 failed is not finite, and step() skips it (with a warning) instead of
    ruining rank 1's parameters while rank 0 skipped: the ranks stay bit-identical."""
    job = run(run_workers, "backward_raises", "--who", "0", "--steps", 4, "--plain-loop", 1,
              "--compression", "topk:ratio=0.01|ef")
    steps = job.loads("steps")
    assert steps[0][1]["outcome"].startswith("raised: boom"), steps[0][1]
    outcome = steps[1][1]["outcome"]
    assert outcome.startswith("non-finite; gradcomp: this step's mean gradient is not finite"), \
        outcome
    assert "skipped on every rank" in outcome, outcome
    assert steps[1][1]["params"] == steps[1][0]["params"], "rank 1 stepped on a NaN mean"
    assert_ranks_agree(job, ["params"])
    assert all(s["outcome"] == "stepped" for s in steps[1][2:])


def test_step_after_a_raising_backward_is_refused(run_workers):
    job = run(run_workers, "backward_raises", "--who", "0", "--steps", 3,
              "--step-after-raise", 1)
    outcome = job.load("steps", 0)[1]["outcome"]
    assert "step() refused: gradcomp: the last backward pass raised on this rank" in outcome
    assert_ranks_agree(job, ["params"])


def test_dead_peer_during_backward_is_a_comm_error(run_workers):
    job = run(run_workers, "dead_peer", "--steps", 4, check=False)
    assert job.returncode == 0, job.describe()
    last = job.load("steps", 0)[-1]
    assert last.get("is_comm_error"), last
    assert last["error"].startswith("gradcomp") or "bucket" in last["error"], last["error"]


def test_a_peer_lost_while_gradients_are_handed_over_is_a_comm_error_from_backward(run_workers):
    """The exchange of the first buckets has failed (rank 1 is gone) before backward hands the
    last gradients over: the hand-over must not raise the failure from inside autograd's hook,
    where it would reach backward()'s caller as a bare RuntimeError without 'gradcomp:'."""
    job = run(run_workers, "dead_peer", "--steps", 4, "--mid-backward", 4, check=False,
              env={"GRADCOMP_TIMEOUT": "2"})
    assert job.returncode == 0, job.describe()
    last = job.load("steps", 0)[-1]
    assert last.get("is_comm_error"), last
    assert last["error"].startswith("gradcomp: bucket "), last["error"]
    assert "rank 1 did not answer" in last["error"], last["error"]


def test_stalled_peer_on_a_process_group_times_out_and_exits(run_workers):
    """The survivor's collective times out after GRADCOMP_TIMEOUT; c10d's worker thread stays
    blocked in a receive from the stopped peer (c10d's own timeout is 30 minutes), and the
    process must still exit: the launcher then stops the job. A process that cannot exit
    outlives the runner's job timeout, which fails the test."""
    job = run_workers("coordination.py", "--case", "stalled_peer", "--steps", 4,
                      env={"GRADCOMP_TIMEOUT": "5"}, timeout=150)
    assert job.returncode != 0, job.describe()
    assert "rank 0 (pid" in job.stderr and "exited with code 3" in job.stderr, job.describe()
    last = job.load("steps", 0)[-1]
    assert last["error_type"] == "TimeoutError", last
    assert last["error"].startswith("gradcomp: bucket"), last["error"]


@pytest.mark.parametrize("compression", ["none", "fp16", "topk:ratio=0.5|ef"])
def test_a_non_finite_mean_is_skipped_under_any_plan(compression):
    # The engine used to check the means only where a route keeps state: under "none" or
    # "fp16" a NaN reached the parameters without the documented skip.
    import gradcomp.torch as gc
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = gc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters(), compression=compression,
                                  min_compress_elements=1)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")  # the exchange runs in backward: the NaN must be there already
    model(x).sum().backward()
    with pytest.warns(RuntimeWarning, match="not finite"):
        opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b), "a non-finite step moved the parameters"
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert not torch.equal(before[0], model.weight), "a finite step moves them"


def test_an_optimizer_is_freed_with_its_last_reference(run_workers):
    """Nothing handed to the C++ side refers back to it: its engine, threads and claims on the
    transport and the parameter servers end with it, so a later optimizer may claim them."""
    job = run_workers("lifetime.py").check()
    for report in job.reports():
        assert report["freed"] == [True, True, True], report


def test_gradcomps_own_gloo_runs_beside_torch_distributed(run_workers):
    """comm_hook(transport="gloo") under DDP: torch's store already serves MASTER_PORT, so
    gradcomp's rendezvous takes a port of its own (it failed with "the port is in use")."""
    job = run(run_workers, "own_gloo_beside_torch", "--steps", 3, "--compression", "fp16",
              world=3)
    steps = assert_ranks_agree(job, ["params"])
    assert steps[0][0]["transport"] == "gloo"
    assert steps[0][0]["params"] != steps[0][-1]["params"]
