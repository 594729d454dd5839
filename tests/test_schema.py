"""The typed config schema (embodirl/schema): one source of defaults (the YAML), of types, ranges and choices
(the schema), every malformed key one sentence and exit 2; no import cycles; no helper taken from config.py."""

import ast
import dataclasses
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import MISSING, OmegaConf

from embodirl import schema
from embodirl.config import available_options, compose, validate
from embodirl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "embodirl"
EXE = [sys.executable, "-m", "embodirl.cli"]


def _check(cfg):
    validate(cfg, check_envs=False, num_devices=2, accelerator="cpu")


# --- one sentence naming the key -----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key, fragment", [
    (["+runner.max_step=3"], "runner.max_step", "unknown key (did you mean runner.max_steps?)"),
    (["runner.max_step=3"], "runner.max_step", "unknown key (did you mean runner.max_steps?)"),
    (["+algorithm.target_kl=0.1"], "algorithm.target_kl", "unknown key"),     # renamed: algorithm.early_stop_kl
    (["runner.max_epochs=3"], "runner.max_epochs", "unknown key"),            # removed: runner.max_steps counts steps
    (["+env.train.num_env=4"], "env.train.num_env", "unknown key"),
    (["+model.hidden_size=4"], "model.hidden_size", "unknown key"),
    (["model=openvla_oft_tiny", "env=toy_reach", "+model.llm.hidden=3"], "model.llm.hidden", "unknown key"),
    (["+surprise=1"], "surprise", "unknown key"),
    (["runner.max_steps=abc"], "runner.max_steps", "must be an integer, got 'abc'"),
    (["algorithm.gamma=high"], "algorithm.gamma", "must be a number"),
    (["runner.only_eval=maybe"], "runner.only_eval", "true or false"),
    (["runner.max_steps=0"], "runner.max_steps", "must be a positive integer, got 0"),
    (["runner.val_check_interval=-1"], "runner.val_check_interval", "non-negative integer"),
    (["runner.save_interval=-5"], "runner.save_interval", "non-negative integer"),
    (["runner.eval_num_videos=-1"], "runner.eval_num_videos", "non-negative integer"),
    (["algorithm.clip_ratio_low=1.5"], "algorithm.clip_ratio_low", "must be in (0, 1)"),
    (["algorithm.clip_ratio_high=-0.2"], "algorithm.clip_ratio_high", "positive number"),
    (["algorithm.update_epochs=0"], "algorithm.update_epochs", "positive integer"),
    (["algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon", "positive number"),
    (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type", "'pid' is not one of fixed, adaptive"),
    (["algorithm.value_coef=-1"], "algorithm.value_coef", "non-negative number"),
    (["rollout.rollout_epoch=0"], "rollout.rollout_epoch", "positive integer"),
    (["rollout.channel.queue_size=0"], "rollout.channel.queue_size", "positive integer"),
    (["actor.optim.warmup_steps=-1"], "actor.optim.warmup_steps", "non-negative integer"),
    (["actor.optim.clip_grad=0"], "actor.optim.clip_grad", "positive number or null"),
    (["actor.replay_buffer.max_bytes=0"], "actor.replay_buffer.max_bytes", "positive number"),
    (["actor.fsdp.param_dtype=fp8"], "actor.fsdp.param_dtype", "not one of float32, bfloat16, float16 or null"),
    (["cluster.num_nodes=0"], "cluster.num_nodes", "positive integer"),
    (["env.train.max_episode_steps=0"], "env.train.max_episode_steps", "positive integer"),
    (["env.eval.video.fps=0"], "env.eval.video.fps", "positive integer"),
    (["env.train.reward_type=dense", "algorithm.reward_type=dense"], "algorithm.reward_type", "not one of chunk_level"),
    (["model.value_type=per_token"], "model.value_type", "not one of chunk_level, action_level or null"),
    (["model=openvla_oft_tiny", "env=toy_reach", "model.lora.rank=0"], "model.lora.rank", "positive integer"),
    (["model.name=gpt"], "model.name", "'gpt' is not one of openvla_oft, pi0, state_mlp"),            # the policy registry
    (["env.train.adapter=gazebo"], "env.train.adapter", "'gazebo' is not one of libero, maniskill, toy"),  # adapters
])
def test_malformed_keys_are_one_sentence_naming_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        _check(compose(overrides))
    message = str(info.value)
    assert info.value.key == key, message
    assert message.startswith(f"{key}: ") and fragment in message, message
    assert "\n" not in message and ". " not in message, message


def test_cli_refuses_an_appended_key_and_a_bad_sweep_job_with_exit_2(tmp_path):
    proc = subprocess.run([*EXE, "train", "+runner.max_step=3"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("embodirl: runner.max_step: unknown key (did you mean runner.max_steps?); every key "
                                   "and its default is in config/ (embodirl train --cfg job)")
    # every sweep job is composed and checked before the first starts: nothing is written
    proc = subprocess.run([*EXE, "train", "-m", "runner.max_steps=1,abc"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "embodirl: runner.max_steps: must be an integer, got 'abc'"
    assert not (tmp_path / "outputs").exists()


# --- one source of defaults ----------------------------------------------------------------------------------
def _schema_classes():
    from embodirl.envs.registry import ADAPTERS
    from embodirl.models.registry import POLICIES

    declared = [r.config_class(n) for r in (ADAPTERS, POLICIES) for n in r.available()]
    assert len([c for c in declared if c is not None]) == 6      # toy, maniskill, libero; state_mlp, openvla_oft, pi0
    seen, todo = [], [schema.Config, *(c for c in declared if c is not None)]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        todo += [f.default_factory for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default_factory)]
    return seen


def test_the_schema_holds_types_and_rules_but_no_values():
    """Every value comes from the YAML tree: a schema field with a default would be a second source."""
    for cls in _schema_classes():
        for f in dataclasses.fields(cls):
            assert f.default is MISSING or dataclasses.is_dataclass(f.default_factory), f"{cls.__name__}.{f.name}"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _flat(node, prefix=""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_dataclasses_that_read_the_config_agree_with_it():
    """A dataclass built from a config section (``from_config``) carries no default of its own for a key of
    that section, or one equal to the composed value (AdvantageParams had gamma=1.0 against the YAML's 0.99)."""
    values = {}
    for key, value in _flat(OmegaConf.to_container(compose(["env=toy_reach"]))):
        values.setdefault(key.rsplit(".", 1)[-1], set()).add(repr(value))
    checked, disagreements = [], []
    for name, path in _modules():
        if "from_config" not in path.read_text() or name.startswith("embodirl.schema"):
            continue
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not (dataclasses.is_dataclass(cls) and isinstance(cls, type) and cls.__module__ == name
                    and hasattr(cls, "from_config")):
                continue
            checked.append(cls.__name__)
            for f in dataclasses.fields(cls):
                if f.default is dataclasses.MISSING or f.name not in values:
                    continue
                if repr(f.default) not in values[f.name]:
                    disagreements.append(f"{name}.{cls.__name__}.{f.name} = {f.default!r}, config: {values[f.name]}")
    assert not disagreements, disagreements


def test_the_algorithms_and_the_actor_read_the_schema_objects_themselves():
    """No second dataclass re-declares the algorithm or actor sections' fields (LossParams and AdvantageParams did,
    with defaults of their own): the actor's settings are the schema's typed sections, converted once."""
    from embodirl.actor.settings import ActorSettings
    from embodirl.algorithms import advantages, losses
    from embodirl.algorithms.section import AlgorithmSection
    from embodirl.schema.sections import ActorSection

    assert not hasattr(losses, "LossParams") and not hasattr(advantages, "AdvantageParams")
    assert {f.name: f.type for f in dataclasses.fields(ActorSettings)} == {"algorithm": "AlgorithmSection",
                                                                           "actor": "ActorSection"}
    settings = ActorSettings.from_config(compose([]))
    assert isinstance(settings.algorithm, AlgorithmSection) and isinstance(settings.actor, ActorSection)
    assert settings.algorithm.gamma == compose([]).algorithm.gamma


@pytest.mark.parametrize("model", available_options("model"))
def test_every_option_is_typed_by_the_schema(model):
    """Each env option with each model option composes into keys the schema declares, of the declared types,
    in range (the schema and the YAML cannot drift apart)."""
    for env in available_options("env"):
        schema.check_types(compose([f"env={env}", f"model={model}"]))


def test_every_key_that_has_a_choice_list_reads_it_from_its_registry():
    from embodirl.algorithms.estimators import ESTIMATORS, register_advantage

    @register_advantage("test_only_estimator")
    def _estimator(inp, algorithm):
        raise NotImplementedError

    try:
        schema.check_types(compose(["algorithm.adv_type=test_only_estimator"]))
    finally:
        del ESTIMATORS._entries["test_only_estimator"]
    with pytest.raises(ConfigError, match="'test_only_estimator' is not one of"):
        schema.check_types(compose(["algorithm.adv_type=test_only_estimator"]))


# --- imports -----------------------------------------------------------------------------------------------
def _import_graph() -> dict[str, set[str]]:
    """Module -> embodirl modules it imports anywhere (top level, inside functions, under TYPE_CHECKING)."""
    modules = dict(_modules())
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_among_embodirl_modules():
    graph = _import_graph()
    assert len(graph) > 80 and "embodirl.schema.sections" in graph["embodirl.schema"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


#: embodirl's folders and top-level modules, lowest first: each may import only from its own entry and those before it
#: (imports inside functions count too). A folder-level arrow that runs back up fails the test below.
LAYERS = [
    {"errors", "paths", "registry", "progress", "placement", "runtime", "dtypes", "checkpoint_layout",
     "config_fields", "atomic_folder"},
    {"envs"}, {"data"}, {"algorithms", "channel"}, {"models"},
    {"schema"},                   # the typed config: what the layers above read; choice lists from the leaves below
    {"rollout"}, {"actor"}, {"workers"},
    {"calibration"},              # doctor --bench's measurements and prediction; the runner writes them into a run
    {"runner"},
    {"config", "overrides"},      # composition and validation (runs the runner's own rules); commands' own sections
    {"tools"},                    # doctor, its memory estimate and the meta-device dry run
    {"demos", "sft", "compare"}, {"cli"},
]


def _layer(module: str) -> tuple[str, int]:
    part = module.split(".")[1] if "." in module else module
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return part, i
    raise AssertionError(f"{module}: its folder {part} is in no layer of LAYERS (tests/test_schema.py)")


def test_folder_level_imports_point_down():
    graph = _import_graph()
    up = []
    for module, deps in graph.items():
        if module == "embodirl":
            continue
        src, low = _layer(module)
        for dep in deps:
            if dep == "embodirl":
                continue
            dst, high = _layer(dep)
            if high > low:
                up.append(f"{module} ({src}) imports {dep} ({dst})")
    assert not up, "imports that run back up the layers:\n" + "\n".join(sorted(up))


def test_the_layer_check_finds_an_upward_arrow(monkeypatch):
    graph = {"embodirl.schema.sections": {"embodirl.runner.checkpoint"}, "embodirl.runner.checkpoint": set()}
    monkeypatch.setitem(globals(), "_import_graph", lambda: graph)
    with pytest.raises(AssertionError, match="embodirl.schema.sections \\(schema\\) imports embodirl.runner.checkpoint"):
        test_folder_level_imports_point_down()


def test_no_module_imports_config_for_a_helper():
    """embodirl.config composes and validates; helpers live where they belong (placement, rollout, the registries)."""
    allowed = {"compose", "validate", "check_group_overrides", "available_options", "sweep_jobs"}
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "embodirl.config":
                taken = {a.name for a in node.names} - allowed
                assert not taken, f"{name} imports {taken} from embodirl.config"


def test_every_module_imports_in_a_fresh_interpreter():
    skip = ("embodirl.envs.libero.simulator", "embodirl.envs.libero.patches", "embodirl.envs.libero.suite")   # need robosuite
    names = [n for n, _ in _modules() if not n.startswith(skip)]
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_sweep_runs_each_job_with_its_own_checked_config(tmp_path):
    """``-m``: every job's config is composed and checked up front, then each runs in output_dir/<job>."""
    toy = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.num_envs=4",
           "env.eval.num_envs=4", "runner.progress_bar=false", "runner.logger.tensorboard=false",
           "runner.val_check_interval=0", "runner.save_interval=0", "runner.max_steps=1"]
    proc = subprocess.run([*EXE, "train", "-m", *toy, "algorithm.gamma=0.9,0.8"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gammas = [OmegaConf.load(tmp_path / "outputs" / "toy_reach_state_mlp" / str(job) / "config.yaml").algorithm.gamma
              for job in (0, 1)]
    assert gammas == [0.9, 0.8]


# --- the typed config is what the code runs on (issue 24) ---------------------------------------------------
#: identifiers that name a config object: ``cfg``, ``*_cfg``, sections and their attributes (``cfg.env.train``,
#: ``self.cfg.runner``, ``actor_fsdp``). JSON files read from disk (a checkpoint's ``config.json``, named ``config``;
#: ``runner_state``; the replay buffer's saved ``rollouts``) are data, not config, and do not count.
CONFIG_WORDS = {"cfg", "conf", "settings", "section", "overrides", "plain"}
CONFIG_SECTIONS = {"runner", "algorithm", "actor", "rollout", "cluster", "env_workers", "env", "model", "train", "eval",
                   "guard", "logger", "optim", "fsdp", "replay_buffer", "channel", "video", "lora", "flow", "llm",
                   "vision"}
#: config reads through dict keys left in embodirl/ (254 when the issue was filed, 165 by this count at a955e6d)
MAX_CONFIG_DICT_READS = 0


def _names_config(receiver: ast.AST) -> bool:
    for node in ast.walk(receiver):
        attribute = isinstance(node, ast.Attribute)
        name = (node.attr if attribute else node.id if isinstance(node, ast.Name) else "").lower()
        if name in CONFIG_WORDS or name.endswith("_cfg") or name.startswith("cfg_"):
            return True
        if attribute and name in CONFIG_SECTIONS:
            return True
        if not name.endswith("_state") and any(name.startswith(f"{s}_") for s in CONFIG_SECTIONS - {"train", "eval"}):
            return True
    return False


def config_dict_reads(root: Path = PACKAGE) -> list[str]:
    """``x["key"]`` (read) and ``x.get("key", ...)`` whose receiver names a config object, as ``path:line: code``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            receiver = None
            if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant)
                    and isinstance(node.slice.value, str)):
                receiver = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                receiver = node.func.value
            if receiver is not None and _names_config(receiver):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_counter_finds_config_dict_reads_and_not_json_data(tmp_path):
    (tmp_path / "m.py").write_text("a = cfg['x']\nb = cfg.model.get('path')\nc = actor_fsdp.get('enabled', 'auto')\n"
                                   "d = config['norm_stats']\ne = runner_state.get('guard')\nf = rollouts['rollouts']\n"
                                   "cfg['y'] = 1\n")
    assert [line.split(": ", 1)[1] for line in config_dict_reads(tmp_path)] == [
        "cfg['x']", "cfg.model.get('path')", "actor_fsdp.get('enabled', 'auto')"]


def test_the_code_reads_the_typed_config_not_dict_keys():
    reads = config_dict_reads()
    assert len(reads) <= MAX_CONFIG_DICT_READS, (
        "config read through dict keys; convert the section once (embodirl.schema.run_config, env_config, "
        "model_config) and read its attributes:\n" + "\n".join(reads))
    assert not (PACKAGE / "plain.py").exists()
    for name, path in _modules():
        text = path.read_text()
        assert "to_plain" not in text and "embodirl.plain" not in text, f"{name} converts a config to plain dicts"
