"""What a simulated run says the scheduler's queues held after each step was scheduled
(``Trajectory.running_depth`` and ``waiting_depth``, the tracer's ``queue.*`` columns)."""

import numpy as np
from test_bad_input import EXP_CONFIG, _experiment

from fitness.sim.engine import simulate
from fitness.sim.models import ExpressionLatencyModel
from fitness.sim.recording import FINISHED
from primitives.data.experiments import load_experiment
from primitives.deployment import DeploymentResolver


def test_a_queue_forms_only_while_every_slot_is_held(tmp_path):
    # two slots, 200 ms steps: a request of 20 tokens holds its slot for about 4 s, and
    # one arrives every second, so requests queue
    spec = load_experiment(_experiment(tmp_path, exp_config=EXP_CONFIG.replace("max_num_seqs: 128", "max_num_seqs: 2")))
    dep = DeploymentResolver().resolve_experiment(spec)
    result = simulate(spec, dep, ExpressionLatencyModel("200000", dep, {}), seed=0, record=True)
    traj, status = result.trajectory, result.requests.status
    running = traj.running_depth(status)
    waiting = traj.waiting_depth(status, spec.request_timeout_s)
    batch = np.diff(traj.step_offsets)
    assert (status == FINISHED).all() and waiting.max() >= 1
    assert running.max() == 2 and (running[waiting > 0] == 2).all()  # nobody waits beside a free slot
    # a request that finished in step k-1 holds its slot while step k is scheduled, unless
    # the engine idled in between
    gapless = np.r_[False, traj.step_start_us[1:] <= traj.step_start_us[:-1] + traj.step_cycle_us[:-1] + 1e-6]
    last = traj.last_step[status == FINISHED]
    held = np.bincount(last[gapless[np.minimum(last + 1, traj.n_steps - 1)]] + 1, minlength=traj.n_steps + 1)
    assert np.array_equal(running - batch, held[: traj.n_steps]) and (running > batch).any()
    # every request waits from its enqueue to its admission: the steps' waiting sums to that
    enq_step = np.searchsorted(traj.step_start_us, traj.enqueue_us, side="left")
    assert waiting.sum() == (traj.admit_step - enq_step).sum()


def test_an_idle_engine_holds_no_finished_request(tmp_path):
    # 20 ms steps, five 20-token requests in 5 s: the engine idles between some of them,
    # and then releases a finished request's slot at once
    spec = load_experiment(_experiment(tmp_path))
    dep = DeploymentResolver().resolve_experiment(spec)
    result = simulate(spec, dep, ExpressionLatencyModel("20000", dep, {}), seed=0, record=True)
    traj, status = result.trajectory, result.requests.status
    running = traj.running_depth(status)
    batch = np.diff(traj.step_offsets)
    # the steps right after a request's last one that started after an idle gap
    after = traj.last_step[status == FINISHED] + 1
    after = after[after < traj.n_steps]
    after = after[traj.step_start_us[after] > traj.step_start_us[after - 1] + traj.step_cycle_us[after - 1] + 1e-6]
    assert len(after) and (running[after] == batch[after]).all()
    assert traj.waiting_depth(status, spec.request_timeout_s).max() == 0


def test_the_queueing_time_counts_the_step_running_at_sending(tmp_path):
    # 200 ms steps, two slots, and 5 ms of queueing per request of the last step started
    # before a request was sent (also while the engine idles after it, as BLIS's model
    # remembers its last batch; none before the first step)
    spec = load_experiment(_experiment(tmp_path, exp_config=EXP_CONFIG.replace("max_num_seqs: 128", "max_num_seqs: 2")))
    dep = DeploymentResolver().resolve_experiment(spec)
    over = {"queueing_base_us": 1000.0, "queueing_per_running_request_us": 5000.0}
    for engine in ("compiled", "python"):
        model = ExpressionLatencyModel("200000", dep, over)
        traj = simulate(spec, dep, model, seed=0, record=True, engine=engine).trajectory
        batch = np.diff(traj.step_offsets)
        k = np.searchsorted(traj.step_start_us, traj.send_us, side="left") - 1
        want = np.where(k >= 0, batch[np.maximum(k, 0)], 0)
        assert np.array_equal(traj.send_depth, want) and set(want) == {0, 1, 2}, engine
        assert np.allclose(traj.enqueue_us - traj.send_us, 1000.0 + 5000.0 * want, rtol=0, atol=1e-6)
