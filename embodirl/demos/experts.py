"""Scripted experts for ManiSkill tabletop tasks, acting in the adapter's ``pd_ee_delta_pos`` action space.

Why not ManiSkill's motion-planning solutions (``mani_skill.examples.motionplanning.panda.solutions``): they
plan with ``mplib``, and both published mplib versions (0.1.1, which mani-skill 3.0.1 pins, and 0.2.1)
crash with a segmentation fault while building the planner's ``ArticulatedModel`` under numpy 2
(ManiSkill issues #1100 and #1359); this project needs numpy 2. The experts below follow the same plans as
those solutions (PushCube: close the gripper, reach behind the cube, push it to the goal; PickCube: reach,
grasp, carry to the goal; StackCube: grasp cube A, lift, place it on cube B, release) with a closed-loop
Cartesian controller on privileged simulator state instead of a joint-space planner. Their actions are
already in the adapter's action space, so no controller conversion is needed (and the recorded demos
replay exactly in the adapter).

An expert is called once per control step with the ManiSkill ``BaseEnv`` (``ManiSkillSimEnv.unwrapped``)
and returns the action float32 ``[4]``: ``[dx, dy, dz]`` in ``[-1, 1]`` (a fraction of the controller's
0.1 m step, root frame = world axes for the Panda tabletop tasks) and the gripper (+1 open, -1 closed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

OPEN, CLOSED = 1.0, -1.0
CONTROL_MODES = ("pd_ee_delta_pos",)


def _p(actor) -> np.ndarray:
    return actor.pose.p[0].cpu().numpy().astype(np.float64)


@dataclass
class Waypoint:
    target: Callable[[Any], np.ndarray]      # BaseEnv (untyped, task-specific actors) -> TCP position (world, m)
    gripper: float
    tol: float = 0.01                        # reached when the TCP is this close (m)
    hold: int = 0                            # then stay this many more steps (grasp / release)
    max_steps: int = 30                      # give up on reaching after this many steps (go on)


class WaypointExpert:
    """Moves the TCP through waypoints with a proportional step (clipped to the controller's range)."""

    def __init__(self, waypoints: list[Waypoint], pos_scale: float = 0.1, gain: float = 1.0):
        self.waypoints, self.pos_scale, self.gain = waypoints, pos_scale, gain
        self.reset()

    def reset(self) -> None:
        self.phase, self.steps_in_phase, self.held = 0, 0, 0

    def __call__(self, base) -> np.ndarray:
        tcp = _p(base.agent.tcp)
        while True:
            wp = self.waypoints[min(self.phase, len(self.waypoints) - 1)]
            delta = wp.target(base) - tcp
            last = self.phase >= len(self.waypoints) - 1
            reached = np.linalg.norm(delta) < wp.tol or self.steps_in_phase >= wp.max_steps
            if reached and self.held >= wp.hold and not last:
                self.phase, self.steps_in_phase, self.held = self.phase + 1, 0, 0
                continue
            break
        if reached:
            self.held += 1
        self.steps_in_phase += 1
        arm = np.clip(self.gain * delta / self.pos_scale, -1.0, 1.0)
        return np.asarray([*arm, wp.gripper], np.float32)


def push_cube(base) -> WaypointExpert:
    goal = lambda b: _p(b.goal_region)
    behind = lambda b, z: _p(b.obj) + np.array([-0.06, 0.0, z - _p(b.obj)[2]])
    return WaypointExpert([
        Waypoint(lambda b: behind(b, 0.06), CLOSED, tol=0.015),
        Waypoint(lambda b: behind(b, 0.02), CLOSED, tol=0.01),
        Waypoint(lambda b: np.array([goal(b)[0] - 0.03, goal(b)[1], 0.02]), CLOSED, tol=0.005),
    ])


def pick_cube(base) -> WaypointExpert:
    cube = lambda b: _p(b.cube)
    return WaypointExpert([
        Waypoint(lambda b: cube(b) + [0, 0, 0.05], OPEN, tol=0.01),
        Waypoint(lambda b: cube(b), OPEN, tol=0.006),
        Waypoint(lambda b: cube(b), CLOSED, tol=1.0, hold=3),
        Waypoint(lambda b: _p(b.goal_site), CLOSED, tol=0.004),
    ])


def stack_cube(base) -> WaypointExpert:
    a = lambda b: _p(b.cubeA)
    on_b = lambda b, dz: _p(b.cubeB) + [0, 0, dz]
    return WaypointExpert([
        Waypoint(lambda b: a(b) + [0, 0, 0.05], OPEN, tol=0.01),
        Waypoint(lambda b: a(b), OPEN, tol=0.006),
        Waypoint(lambda b: a(b), CLOSED, tol=1.0, hold=3),
        Waypoint(lambda b: on_b(b, 0.08), CLOSED, tol=0.01),
        Waypoint(lambda b: on_b(b, 0.045), CLOSED, tol=0.005),
        Waypoint(lambda b: on_b(b, 0.045), OPEN, tol=1.0, hold=2),
        Waypoint(lambda b: on_b(b, 0.09), OPEN, tol=0.01),
    ])


EXPERTS: dict[str, Callable[[object], WaypointExpert]] = {
    "PushCube-v1": push_cube,
    "PickCube-v1": pick_cube,
    "StackCube-v1": stack_cube,
}
