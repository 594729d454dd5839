"""Action conventions between a policy and an env (embodirl/envs/conventions.py): each side declares its own, the
rollout converts in one place, and a pairing that cannot be converted is one sentence before any worker starts.

The grasp tests drive a real π0 (transformers' PI0 at tiny size) and a real OpenVLA-OFT (tiny) through the path a run
takes - the driver's check, an env worker's rollout collector, an inference worker - into a real LIBERO scene, and
read the Panda's finger joints from MuJoCo afterwards. The policies' normalisation statistics pin their gripper output
(π0: the actions' standard deviation 0 and the mean at the command; OFT: q01 = q99 = the command), as a checkpoint's
statistics would."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from embodirl.config import compose, validate
from embodirl.envs import conventions as C
from embodirl.envs.registry import ADAPTERS
from embodirl.envs.toy import ToyAdapter, ToyEnvConfig
from embodirl.errors import ConfigError
from embodirl.schema.envs import action_conversion
from tests import cli_runs

LIBERO = ["env=libero_object", "env.train.image_size=[64,64]", "env.eval.image_size=[64,64]", "env.train.num_envs=1",
          "env.eval.num_envs=1", "env.train.max_episode_steps=16", "env.eval.max_episode_steps=16",
          "env.train.cameras=[agentview]", "env.eval.cameras=[agentview]"]
OPEN_WIDTH, CLOSED_WIDTH = 0.07, 0.01        # m between the Panda's fingers: wide open / closed on nothing
SOUP_TASK = 0


def run_config(*overrides: str):
    return validate(compose(list(overrides)), check_envs=False, num_devices=2, accelerator="cpu")


@functools.cache
def conversion(model: str, env: str = "libero_object"):
    """What a run of ``model`` in ``env`` hands its env workers (the driver's check)."""
    return action_conversion(run_config(f"env={env}", f"model={model}"), "env.train")


def oft_eval_loop(actions: np.ndarray) -> np.ndarray:
    """OpenVLA-OFT's ``experiments/robot/robot_utils.py`` as ``run_libero_eval.py`` applies it: ``normalize_gripper_action
    (binarize=True)`` then ``invert_gripper_action``."""
    out = np.array(actions, copy=True)
    out[..., -1] = 2 * (out[..., -1] - 0.0) / (1.0 - 0.0) - 1
    out[..., -1] = np.sign(out[..., -1])
    out[..., -1] = out[..., -1] * -1.0
    return out


# --------------------------------------------------------------------------------------------------
# the conversion (no simulator)
# --------------------------------------------------------------------------------------------------
def test_openvla_oft_into_libero_is_ofts_own_conversion_bit_for_bit():
    rng = np.random.default_rng(0)
    grippers = np.r_[0.0, 0.1, 0.49, 0.5, 0.51, 0.9, 1.0, np.nextafter(0.5, 0), np.nextafter(0.5, 1), rng.uniform(0, 1, 40)]
    for dtype in (np.float64, np.float32):
        actions = np.concatenate([rng.uniform(-1, 1, (len(grippers), 6)), grippers[:, None]], axis=1).astype(dtype)
        ours, theirs = conversion("openvla_oft_tiny").to_env(actions), oft_eval_loop(actions)
        assert ours.dtype == dtype
        np.testing.assert_array_equal(ours, theirs)
        np.testing.assert_array_equal(np.signbit(ours), np.signbit(theirs))      # -0.0 at the tie too
        assert ours[:, :6].tobytes() == actions[:, :6].tobytes()                 # the arm passes untouched
    chunk = np.zeros((2, 3, 7))
    chunk[0, :, -1], chunk[1, :, -1] = 1.0, 0.0                                  # (B, H, A): open, close
    np.testing.assert_array_equal(conversion("openvla_oft_tiny").to_env(chunk)[..., -1], [[-1.0] * 3, [1.0] * 3])


def test_pi0_passes_into_libero_unchanged_and_each_pair_round_trips_demonstrations():
    actions = np.random.default_rng(1).uniform(-1, 1, (5, 4, 7)).astype(np.float32)
    assert conversion("pi0_tiny").identity and conversion("pi0_tiny").to_env(actions) is actions   # as openpi sends it
    assert conversion("state_mlp", "maniskill_pushcube").identity                                   # native
    assert conversion("openvla_oft_tiny", "toy_reach").identity                                      # no gripper there
    demos = np.random.default_rng(2).uniform(-1, 1, (6, 4)).astype(np.float32)
    demos[:, -1] = [1, -1, 1, 1, -1, -1]                                       # ManiSkill: +1 open, -1 close
    pi0 = conversion("pi0_tiny", "maniskill_pushcube_rgb")
    np.testing.assert_array_equal(pi0.from_env(demos)[:, -1], -demos[:, -1])   # π0 learns LIBERO's sign
    np.testing.assert_array_equal(pi0.to_env(pi0.from_env(demos)), demos)
    oft = conversion("openvla_oft_tiny", "maniskill_pushcube_rgb")
    np.testing.assert_array_equal(oft.from_env(demos)[:, -1], (demos[:, -1] + 1) / 2)   # OFT learns [0, 1], 1 open
    np.testing.assert_array_equal(oft.to_env(oft.from_env(demos)), demos)
    assert oft.from_env(demos)[:, :3].tobytes() == demos[:, :3].tobytes()


def test_the_policy_sees_the_env_bounds_in_its_own_convention():
    from embodirl.envs.base import EnvSpec

    spec = EnvSpec(action_dim=7, max_episode_steps=8, task_descriptions=["t"], action_low=[-1.0] * 7,
                   action_high=[1.0] * 7, action_convention=C.ActionConvention(C.OSC_POSE_DELTA,
                                                                             C.SIGNED_CLOSE_POSITIVE))
    oft = C.policy_spec(spec, C.ActionConvention(C.ANY_ARM, C.OPEN01))
    assert oft.action_low == [-1.0] * 6 + [0.0] and oft.action_high == [1.0] * 7
    assert C.policy_spec(spec, C.ActionConvention(C.ANY_ARM, C.SIGNED_CLOSE_POSITIVE)) is spec


# --------------------------------------------------------------------------------------------------
# declarations
# --------------------------------------------------------------------------------------------------
def test_families_and_adapters_declare_their_conventions():
    from embodirl.models.registry import policy_convention

    assert policy_convention(compose(["model=openvla_oft_tiny"]).model) == C.ActionConvention(C.ANY_ARM, C.OPEN01)
    assert policy_convention(compose(["model=pi0"]).model) == C.ActionConvention(C.ANY_ARM, C.SIGNED_CLOSE_POSITIVE)
    assert policy_convention(compose(["model=state_mlp"]).model) == C.NATIVE_CONVENTION
    override = compose(["model=pi0_tiny", "model.action_convention.gripper=open01"]).model
    assert policy_convention(override) == C.ActionConvention(C.ANY_ARM, C.OPEN01)     # a checkpoint trained so
    assert conversion("pi0_tiny").env == C.ActionConvention(C.OSC_POSE_DELTA, C.SIGNED_CLOSE_POSITIVE)
    assert conversion("pi0_tiny", "maniskill_pushcube_rgb").env == C.ActionConvention("maniskill/pd_ee_delta_pos",
                                                                                       C.SIGNED_OPEN_POSITIVE)
    assert conversion("pi0_tiny", "maniskill_putcarrot").env.arm == "maniskill/default"   # the robot's own mode
    assert conversion("pi0_tiny", "toy_reach").env.gripper == C.NO_GRIPPER


def test_maniskill_opens_its_gripper_at_plus_one_as_declared():
    """The ManiSkill adapter's declaration against the real simulator: PickCube's Panda under pd_ee_delta_pos and
    pd_ee_delta_pose (its config's controller and the 6-D one), gripper +1 then -1."""
    from omegaconf import OmegaConf

    from embodirl.envs.maniskill.simulator import ManiSkillSimEnv
    from embodirl.envs.registry import env_convention

    for mode in ("pd_ee_delta_pos", "pd_ee_delta_pose"):
        cfg = OmegaConf.to_container(compose(["env=maniskill_pickcube", "model=openvla_oft_tiny",
                                              f"env.train.control_mode={mode}"]).env.train, resolve=True)
        assert env_convention(cfg) == C.ActionConvention(f"maniskill/{mode}", C.SIGNED_OPEN_POSITIVE)
        env = ManiSkillSimEnv(cfg, seed=0)
        try:
            env.reset(init_state_id=0)
            widths = []
            for command in (1.0, -1.0):
                chunk = np.zeros((10, env.spec.action_dim), np.float32)
                chunk[:, -1] = command
                env.step_chunk(chunk)
                widths.append(float(env.unwrapped.agent.robot.get_qpos()[0, -2:].sum()))   # both fingers, m
            assert widths[0] > OPEN_WIDTH and widths[1] < CLOSED_WIDTH, (mode, widths)
        finally:
            env.close()


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------
class UndeclaredToyAdapter(ToyAdapter):
    """The toy simulator behind an adapter that declares no action convention."""

    action_convention = None


@pytest.fixture
def undeclared_adapter(monkeypatch) -> str:
    """:class:`UndeclaredToyAdapter` registered as a module outside embodirl registers itself, for this test only (the
    registry is the process's: other tests list the adapters)."""
    name = "my_lab.undeclared_sim"
    monkeypatch.setitem(ADAPTERS._entries, name, UndeclaredToyAdapter)
    monkeypatch.setitem(ADAPTERS._configs, name, ToyEnvConfig)
    return name


@pytest.mark.parametrize("overrides, message", [
    (["env=libero_object", "model=pi0_tiny", "model.action_convention.arm=maniskill/pd_ee_delta_pose"],
     r"^model.action_convention.arm: pi0 acts in the arm space maniskill/pd_ee_delta_pose but env.train \(libero\) "
     r"consumes osc_pose_delta, and arm spaces cannot be converted; choose an env of that action space$"),
    (["env=libero_object", "model=pi0_tiny", "model.action_convention.gripper=none"],
     r"^model.action_convention.gripper: pi0 emits no gripper command but env.train \(libero\) consumes one "
     r"\(signed_close_positive\); choose a policy with a gripper dim$"),
    (["env=libero_object", "model=pi0_tiny", "model.action_convention.gripper=closed01"],
     r"^model.action_convention.gripper: 'closed01' is not one of open01, signed_close_positive, "),
])
def test_a_pairing_that_cannot_be_converted_is_one_sentence(overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        run_config(*overrides)
    assert "\n" not in str(info.value)


def test_an_adapter_that_declares_nothing_is_refused(undeclared_adapter):
    with pytest.raises(ConfigError, match=rf"^env.train.adapter: simulator adapter '{undeclared_adapter}' declares no "
                                          r"action convention, so state_mlp's actions cannot be checked against what "
                                          r"it consumes; give the adapter action_convention\(cfg\)"):
        run_config("env=toy_reach", f"env.train.adapter={undeclared_adapter}",
                   f"env.eval.adapter={undeclared_adapter}")


def test_a_policy_that_declares_nothing_is_refused():
    libero = C.ActionConvention(C.OSC_POSE_DELTA, C.SIGNED_CLOSE_POSITIVE)
    with pytest.raises(ConfigError, match=r"^model.action_convention: my_policy declares no action convention, so its "
                                          r"actions cannot be converted to what env.eval \(libero\) consumes \(arm "
                                          r"osc_pose_delta, gripper signed_close_positive\); set "
                                          r"model.action_convention.arm and .gripper$"):
        C.pairing(None, libero, model_name="my_policy", env_key="env.eval", adapter="libero")


def test_an_openvla_oft_libero_checkpoint_is_refused_in_another_arm_space(tmp_path):
    """A checkpoint whose statistics are a LIBERO dataset's acts in LIBERO's OSC_POSE delta: not in ManiSkill's 7-D
    pd_ee_delta_pose, which has the same width."""
    import json

    folder = tmp_path / "oft_libero"
    folder.mkdir()
    (folder / "dataset_statistics.json").write_text(json.dumps({"libero_10_no_noops": {}}))
    with pytest.raises(ConfigError, match=r"^model.action_convention.arm: openvla_oft acts in the arm space "
                                          r"osc_pose_delta but env.train \(maniskill\) consumes "
                                          r"maniskill/pd_ee_delta_pose, and arm spaces cannot be converted"):
        run_config("env=maniskill_pickcube_rgb", "model=openvla_oft_tiny", f"model.path={folder}",
                   "env.train.control_mode=pd_ee_delta_pose", "env.eval.control_mode=pd_ee_delta_pose")


def test_the_cli_refuses_before_any_worker_starts(tmp_path):
    proc = cli_runs.run(["train", *LIBERO, "model=pi0_tiny", "model.action_convention.arm=maniskill/pd_ee_delta_pos",
                         f"runner.output_dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith("model.action_convention.arm: pi0 acts in the arm space maniskill/pd_ee_delta_pos but "
                              "env.train (libero) consumes osc_pose_delta, and arm spaces cannot be converted; choose "
                              "an env of that action space"), proc.stderr[-2000:]
    assert "Ray" not in proc.stdout + proc.stderr and not (tmp_path / "run").exists()


# --------------------------------------------------------------------------------------------------
# grasps in LIBERO through the rollout path
# --------------------------------------------------------------------------------------------------
def pin_gripper(policy, model: str, command: float) -> None:
    """Statistics that make ``policy``'s un-normalised actions 0 on the arm and ``command`` on the gripper."""
    if model == "pi0_tiny":
        policy.set_statistics({"actions_mean": [0.0] * 6 + [command], "actions_std": [0.0] * 7})
    else:
        bounds = [0.0] * 6 + [command]
        policy.set_statistics({"libero_object": {"action": {"q01": bounds, "q99": bounds, "min": bounds, "max": bounds,
                                                            "mask": [True] * 7},
                                                 "proprio": {"q01": [-1.0] * 8, "q99": [1.0] * 8, "min": [-1.0] * 8,
                                                             "max": [1.0] * 8, "mask": [True] * 8}}})


def finger_width(sim) -> float:
    """The distance between the Panda's two finger joints, read from MuJoCo (m)."""
    inner = sim.libero_env.env
    qpos = inner.sim.data.qpos[inner.robots[0]._ref_gripper_joint_pos_indexes]
    return float(qpos[0] - qpos[1])


@pytest.mark.parametrize("model, close, open_", [("pi0_tiny", 1.0, -1.0),        # LIBERO's own: +1 close, -1 open
                                                 ("openvla_oft_tiny", 0.0, 1.0)])  # OFT's [0, 1]: 1 open
def test_a_policys_close_closes_and_its_open_opens_libero_gripper(model, close, open_):
    from embodirl.envs.libero.simulator import LiberoSimEnv
    from embodirl.envs.registry import env_convention
    from embodirl.envs.vector.vector_env import ProcessVectorEnv
    from embodirl.models.registry import make_policy
    from embodirl.rollout.starts import EpisodeStarts
    from embodirl.workers.env_worker import EnvWorker
    from embodirl.workers.inference_worker import EVAL, InferenceWorker

    run = run_config(*LIBERO, f"model={model}")
    sims = []

    def in_process(env_cfg, *, num_envs, seed, env_offset):
        """LIBERO's own simulators, kept in this process so that the test reads MuJoCo; the spec as make_env gives
        it."""
        sims.extend(LiberoSimEnv(env_cfg, seed=seed + i) for i in range(num_envs))
        venv = ProcessVectorEnv.from_config([lambda sim=sim: sim for sim in sims], env_cfg, processes=False)
        venv.spec = dataclasses.replace(venv.spec, action_convention=env_convention(env_cfg))
        return venv

    H = run.model.action_chunk
    worker = EnvWorker(run.env.train, num_stages=1, envs_per_stage=1, num_decisions=16 // H, env_builder=in_process,
                       conversion=action_conversion(run, "env.train"))
    try:
        policy = make_policy(run.model, worker.spec())
        worker.connect_local(InferenceWorker(run.model, worker.spec(), policy=policy))
        widths, executed = {}, {}
        for name, command in (("close", close), ("open", open_)):
            pin_gripper(policy, model, command)
            traj = worker.collect(EpisodeStarts(np.array([SOUP_TASK]), np.array([0])), seed=0, mode=EVAL)
            widths[name] = finger_width(sims[0])                                # after 16 steps from an open hand
            executed[name] = traj.get("action_chunk")[0, :, :, -1].numpy()      # (T, H): what LIBERO was given
        assert widths["close"] < CLOSED_WIDTH and widths["open"] > OPEN_WIDTH, widths
        assert np.allclose(executed["close"], 1.0, atol=1e-3) and np.allclose(executed["open"], -1.0, atol=1e-3)
    finally:
        worker.close()
