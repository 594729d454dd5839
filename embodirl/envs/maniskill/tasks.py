"""ManiSkill 3 task table: which task ids exist, what each asks for in words, and whether the data a
task needs is on disk. Nothing here builds a simulator, so the checks run before any worker starts.

* :func:`task_spec` - the ManiSkill registry entry of a task id; an unknown id is a
  :class:`~embodirl.errors.ConfigError` naming close matches (or every available id).
* :func:`instruction` - the natural-language instruction a VLA policy is prompted with. Known tasks
  have a hand-written sentence (Bridge digital twins use ManiSkill's own instruction); any other id
  gets one derived from its name (``"PullCubeTool-v1"`` -> ``"pull cube tool"``).
* :func:`check_assets` - raises :class:`~embodirl.errors.AssetsMissing` with the exact
  ``python -m mani_skill.utils.download_asset <id>`` command when a task's downloadable data (Bridge
  scenes, YCB objects, PartNet-Mobility models, robot descriptions) is absent.
* :func:`asset_prompt_guard` - ManiSkill asks on stdin before downloading anything it finds missing
  at construction time (a robot chosen inside a task's constructor, say); in a worker process that
  question would hang or crash, so the guard turns it into the same one-sentence error.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import re
from collections.abc import Iterator

from embodirl.errors import AssetsMissing, ConfigError
from embodirl.runtime import configure

DOWNLOAD_COMMAND = "python -m mani_skill.utils.download_asset"
_MAX_CLOSE_MATCHES = 5
_MAX_LISTED_IDS = 80

# Instructions for the tasks people train VLAs on. Colours and goals follow each task's scene in
# mani_skill/envs/tasks (e.g. PickCube: red cube, green goal marker; PushCube: blue cube, red/white
# target disc). Bridge digital twins use the instruction ManiSkill itself returns
# (``get_language_instruction``) so that policies trained on Bridge data see their own prompt.
INSTRUCTIONS: dict[str, str] = {
    "PickCube-v1": "pick up the red cube and move it to the goal",
    "PushCube-v1": "push the blue cube to the red and white target",
    "PullCube-v1": "pull the blue cube back to the red and white target",
    "PokeCube-v1": "use the peg to poke the red cube to the target",
    "StackCube-v1": "stack the red cube on top of the green cube",
    "StackPyramid-v1": "stack the three cubes into a pyramid",
    "PegInsertionSide-v1": "insert the peg into the hole in the box from the side",
    "LiftPegUpright-v1": "lift the peg lying on the table and stand it upright",
    "PlugCharger-v1": "plug the charger into the receptacle on the wall",
    "PlaceSphere-v1": "place the blue sphere into the bin",
    "RollBall-v1": "push the ball so that it rolls into the goal region",
    "PushT-v1": "push the T-shaped block onto the T-shaped target",
    "PullCubeTool-v1": "use the tool to pull the cube closer",
    "PickSingleYCB-v1": "pick up the object and move it to the goal",
    "PickClutterYCB-v1": "pick up the target object from the cluttered table",
    "AssemblingKits-v1": "insert the shape into the matching slot of the kit",
    "TurnFaucet-v1": "turn the faucet handle",
    "OpenCabinetDrawer-v1": "open the cabinet drawer",
    "OpenCabinetDoor-v1": "open the cabinet door",
    "TwoRobotPickCube-v1": "pass the cube between the two robots and lift it to the goal",
    "TwoRobotStackCube-v1": "use both robots to stack the blue cube on the green cube",
    "DrawTriangle-v1": "draw the triangle shown on the canvas",
    "DrawSVG-v1": "draw the shape shown on the canvas",
    "PickCubeSO100-v1": "pick up the red cube and move it to the goal",
    "PickCubeWidowXAI-v1": "pick up the red cube and move it to the goal",
    "SO100GraspCube-v1": "grasp the cube and lift it",
    "PutCarrotOnPlateInScene-v1": "put carrot on plate",
    "PutEggplantInBasketScene-v1": "put eggplant into yellow basket",
    "StackGreenCubeOnYellowCubeBakedTexInScene-v1": "stack the green block on the yellow block",
    "PutSpoonOnTableClothInScene-v1": "put the spoon on the towel",
}


def _registry() -> dict:
    configure()  # before sapien is imported (software Vulkan on machines without a GPU)
    import mani_skill.envs  # noqa: F401 - registers every task
    from mani_skill.utils.registration import REGISTERED_ENVS

    return REGISTERED_ENVS


def task_spec(task: str, key: str = "env.task"):
    """The ManiSkill :class:`mani_skill.utils.registration.EnvSpec` of ``task``."""
    registry = _registry()
    if task in registry:
        return registry[task]
    ids = sorted(registry)
    close = difflib.get_close_matches(str(task), ids, n=_MAX_CLOSE_MATCHES, cutoff=0.5)
    if close:
        hint = f"did you mean {', '.join(close)}?"
    else:
        listed = ", ".join(ids[:_MAX_LISTED_IDS]) + (" ..." if len(ids) > _MAX_LISTED_IDS else "")
        hint = f"available: {listed}"
    raise ConfigError(key, f"unknown ManiSkill task '{task}'; {hint}")


def instruction(task: str) -> str:
    """Natural-language instruction for ``task`` (hand-written, else derived from the id)."""
    if task in INSTRUCTIONS:
        return INSTRUCTIONS[task]
    name = re.sub(r"-v\d+$", "", task)
    name = re.sub(r"^MS-", "", name).replace("_", " ").replace("-", " ")
    words = re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)
    return " ".join(w.lower() for w in words) or task


def _default_robot_uids(cls) -> list[str]:
    """Robot uids a task builds by default, where its constructor signature names them."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        param = inspect.signature(init).parameters.get("robot_uids")
        if param is None or param.default is inspect.Parameter.empty:
            continue
        default = param.default
        if isinstance(default, str):
            return [default]
        if isinstance(default, tuple) and all(isinstance(u, str) for u in default):
            return list(default)
        return []
    return []


def missing_assets(task: str) -> list[str]:
    """Download ids (ManiSkill data sources or groups) that ``task`` needs and that are not on disk:
    the task's own ``asset_download_ids`` and those of the robots its constructor names."""
    from mani_skill.agents import REGISTERED_AGENTS
    from mani_skill.utils import assets

    spec = task_spec(task)
    wanted = list(spec.asset_download_ids or [])
    for uid in _default_robot_uids(spec.cls):
        agent = REGISTERED_AGENTS.get(uid)
        if agent is not None:
            wanted.extend(agent.asset_download_ids or [])
    missing = []
    for asset_id in dict.fromkeys(wanted):
        if asset_id in assets.DATA_GROUPS:
            sources = assets.expand_data_group_into_individual_data_source_ids(asset_id)
        else:
            sources = [asset_id]
        if any(not assets.is_data_source_downloaded(s) for s in sources):
            missing.append(asset_id)
    return missing


def _where(asset_id: str) -> str:
    from mani_skill.utils import assets

    source = assets.DATA_SOURCES.get(asset_id)
    if source is None or source.target_path is None:
        return ""
    return f" (expected at {source.output_dir / source.target_path})"


def assets_missing_error(task: str, asset_ids: list[str]) -> AssetsMissing:
    what = ", ".join(f"{a}{_where(a)}" for a in asset_ids)
    command = " && ".join(f"{DOWNLOAD_COMMAND} {a}" for a in asset_ids)
    return AssetsMissing(f"assets missing: {what} for ManiSkill task {task}; run {command}")


def check_assets(task: str) -> None:
    """Raise :class:`AssetsMissing` (one sentence with the download command) if ``task`` lacks data."""
    missing = missing_assets(task)
    if missing:
        raise assets_missing_error(task, missing)


@contextlib.contextmanager
def asset_prompt_guard(task: str) -> Iterator[None]:
    """While building ``task``, answer ManiSkill's interactive "download now?" question with an
    :class:`AssetsMissing` error instead of reading stdin."""
    from mani_skill.utils import download_asset

    def refuse(message: str) -> bool:
        robot = re.search(r"Robot (\S+) has assets", message)
        ids = re.search(r"requires asset\(s\) (.+?) which could not be found", message)
        if robot is not None:
            asset_ids = [robot.group(1)]       # a robot uid is also a download group id
        elif ids is not None:
            asset_ids = [a.strip() for a in ids.group(1).split(",")]
        else:
            raise AssetsMissing(f"assets missing for ManiSkill task {task}: {message.strip()}")
        raise assets_missing_error(task, asset_ids)

    original = download_asset.prompt_yes_no
    download_asset.prompt_yes_no = refuse
    try:
        yield
    finally:
        download_asset.prompt_yes_no = original
