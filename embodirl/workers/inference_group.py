"""The inference worker group: R :class:`~embodirl.workers.inference_worker.InferenceWorker` s in a
:class:`~embodirl.workers.worker_set.WorkerSet` (in this process or on Ray), their weights and restarts.

Weights reach the workers one way: a :class:`~embodirl.workers.weight_transfer.WeightHandle` they read with
``receive_weights`` - the actor ranks' publication, or, where the driver holds the weights (evaluation of a
checkpoint, tests), the same packed publication posted from the driver's own outbox."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from embodirl.models.registry import model_config
from embodirl.workers.deadlines import PROBE_S, CallTimes, WorkerHung, is_stopped, where
from embodirl.workers.inference_worker import InferenceWorker
from embodirl.workers.layout import placement_options
from embodirl.workers.weight_sync import WeightPublisher
from embodirl.workers.worker_set import WorkerSet

log = logging.getLogger(__name__)


class InferenceGroup:
    """R inference workers. In this process a worker given the driver's ``policy`` acts with that very
    object (no copy, no weight transfer: the actor's updates are its weights) on its device, and samples
    with the driver's generators; a Ray worker gets a copy and seeds its own (``seed + r + R*restarts``)."""

    def __init__(self, model_cfg, env_spec, *, num_workers: int, engine: str, sampling: Mapping,
                 remote: bool, placement=None, process_vars: Mapping[str, str] | None = None, policy=None,
                 seed: int | None = None, init_seed: int | None = None, weight_source=None,
                 trainable_dtype: str | None = None, merge_lora: bool = False, compile_blocks: bool = False,
                 deadline=None):
        self.model_cfg = model_config(model_cfg)   # the typed model section (a mapping of it is converted once)
        self.env_spec = env_spec
        self.engine = engine
        self.sampling = dict(sampling)
        self.process_vars = dict(process_vars or {})
        self._policy = policy            # an existing policy object instead of building one
        self.seed = seed
        self.init_seed = init_seed       # seeded policy initialisation (the actor ranks use the same)
        self.trainable_dtype = trainable_dtype   # a built copy computes its trainable tensors as the actor does
        self.merge_lora = bool(merge_lora)       # ... or with its adapters folded into its weights
        self.compile_blocks = bool(compile_blocks)   # a built copy compiles its networks (rollout.compile)
        self.publisher: WeightPublisher | None = None
        self._outbox = None              # the driver's own publications (WeightOutbox), made on first use
        #: where a restarted worker's weights come from when an actor group publishes: a callable
        #: returning a full WeightHandle, or None while there is none (then: the driver's publications, if any)
        self.weight_source = weight_source
        self._version = 0                # the last version every worker applied
        self.sync_paths: dict[str, int] = {}   # how the last publication reached the workers
        self.generation = [0] * num_workers   # bumped at every restart of worker r
        self.infos: list[dict] = []
        self.workers = WorkerSet(InferenceWorker, remote=remote, options_for=placement_options(placement, "rollout"),
                                 times=CallTimes(deadline), label="inference worker",
                                 info_of=lambda r: self.infos[r] if r < len(self.infos) else None)
        self.shares_policy = policy is not None and not remote
        try:
            for r in range(num_workers):
                self._start(r)
            self.infos = self.workers.call_all(InferenceWorker.info)    # remote: also waits until every worker is built
        except BaseException:
            self.close()
            raise

    @property
    def remote(self) -> bool:
        return self.workers.remote

    def __len__(self) -> int:
        return len(self.workers)

    def _driver_publisher(self) -> WeightPublisher:
        if self.publisher is None:
            # what a restarted worker loads when nothing was published yet: worker 0's start weights
            self.publisher = WeightPublisher(self.workers.call(0, InferenceWorker.trainable_state_dict))
        return self.publisher

    def _post(self, update):
        """A driver-side update as a publication, packed once like the actor's (the same ``WeightHandle``)."""
        from embodirl.workers import process_env
        from embodirl.workers.weight_transfer import WeightOutbox

        if self._outbox is None:
            self._outbox = WeightOutbox(process_env.describe()["node_id"])
        return self._outbox.post(update, set(self.consumer_nodes()), inline=not self.remote)

    def _start(self, r: int) -> None:
        kwargs = dict(engine=self.engine, sampling=self.sampling, process_vars=self.process_vars,
                      policy=self._policy, init_seed=self.init_seed)
        if self.shares_policy:           # the driver's policy acts where it is
            param = next(self._policy.parameters(), None)
            kwargs["device"] = str(param.device) if param is not None else "cpu"
        else:
            kwargs.update(trainable_dtype=self.trainable_dtype, merge_lora=self.merge_lora,
                          compile_blocks=self.compile_blocks)
            if self.seed is not None and self.remote:
                kwargs["seed"] = self.seed + r + len(self.generation) * self.generation[r]
        self.workers.start(r, self.model_cfg, self.env_spec, **kwargs)

    # --- weights -----------------------------------------------------------------------------------
    def publish_weights(self, tensors: Mapping, version: int | None = None, *, full: bool = False) -> int:
        """Publish changed trainable tensors from the driver (as an actor rank would); every worker holds them on
        return. ``full``: replace every trainable tensor by ``tensors`` at ``version`` (a full update): the actor's
        start or resumed weights, or a checkpoint's for evaluation."""
        if full:
            if version is None:
                raise TypeError("publish_weights(full=True) needs the version of the tensors")
            return self.receive_weights(self._post(self._driver_publisher().reset(tensors, version)))
        return self.receive_weights(self._post(self._driver_publisher().publish_weights(tensors, version)))

    def receive_weights(self, handle) -> int:
        """Every worker applies the actor group's publication ``handle`` (it reads the tensors itself:
        shared memory on rank 0's node, the object store elsewhere; a worker sharing the actor's module
        gets the version only, an int); returns the version."""
        answers = self.workers.call_all(InferenceWorker.receive_weights, handle)
        version = int(handle) if isinstance(handle, int) else handle.version
        versions = [v for v, _ in answers]
        if any(v != version for v in versions):
            raise RuntimeError(f"inference workers hold weight versions {versions} after publishing v{version}")
        self.sync_paths = {}
        for _, path in answers:
            self.sync_paths[path] = self.sync_paths.get(path, 0) + 1
        self._version = version
        return version

    def consumer_nodes(self) -> list:
        return sorted({info.get("node_id") for info in self.infos}, key=str)

    @property
    def version(self) -> int:
        """The weight version every worker holds (the last publication they applied)."""
        return self._version

    def weight_versions(self) -> list[int]:
        return self.workers.call_all(InferenceWorker.weight_version)

    def rng_states(self) -> list[dict] | None:
        """Each Ray worker's generator states (it samples actions in its own process); None when the
        workers sample with the driver's generators (saved with the driver's state)."""
        return self.workers.call_all(InferenceWorker.rng_state) if self.remote else None

    def set_rng_states(self, states: list[dict] | None) -> None:
        """Restore :meth:`rng_states` (a resumed run); skipped with a warning when the number of
        workers changed since they were saved."""
        if not self.remote or states is None:
            return
        if len(states) != len(self.workers):
            log.warning("the checkpoint holds RNG states of %d inference workers, this run has %d: their action "
                        "sampling is reseeded", len(states), len(self.workers))
            return
        self.workers.call_each(InferenceWorker.set_rng_state, states)

    # --- faults and lifecycle ------------------------------------------------------------------------
    def restart(self, r: int, cause: str = "") -> None:
        """Replace worker ``r`` by a new one holding the last published weights."""
        self.workers.kill(r)
        log.warning("inference worker %d died%s; restarting it with weights v%d", r, f" ({cause})" if cause else "",
                    self.version)
        self.generation[r] += 1
        self._start(r)
        self.infos[r] = self.workers.call(r, InferenceWorker.info)
        handle = self.weight_source() if self.weight_source is not None else None
        if handle is None and self.publisher is not None:
            handle = self._post(self.publisher.publish_weights(full=True))
        if handle is not None:      # else nothing was published: the rebuilt worker's seeded start weights are current
            self.workers.call(r, InferenceWorker.receive_weights, handle)

    def explain(self, hung: WorkerHung) -> WorkerHung:
        """The cause of an env worker's call past its deadline: an inference worker that does not answer a liveness
        probe either (stopped, or stuck in a decision) is named instead; else ``hung`` itself."""
        if not self.remote or hung.label == self.workers.label:     # it names an inference worker already
            return hung
        silent = self.workers.silent(InferenceWorker.ready, PROBE_S)
        if not silent:
            return hung
        stopped = {r: is_stopped(self.infos[r]) for r in silent}
        named = ", ".join(f"inference worker {r}{where(self.infos[r], stopped[r])}" for r in silent)
        return WorkerHung(f"{named} did not answer a liveness check within {PROBE_S:g} s after {hung}",
                          [(self.infos[r].get("host"), self.infos[r].get("pid")) for r in silent], self.workers.label)

    def hung_answer(self, r: int, cause: BaseException) -> WorkerHung:
        """Inference worker ``r`` did not answer an env worker's batch in time (``cause``: the env worker's
        :class:`~embodirl.workers.transport.InferenceWorkerHung`)."""
        info = self.infos[r] if r < len(self.infos) else None
        reason = str(getattr(cause, "cause", cause)).strip().splitlines()[0]
        return WorkerHung(f"inference worker {r}{where(info, is_stopped(info))} {reason}",
                          [(info.get("host"), info.get("pid"))] if info else [], self.workers.label)

    def forget_channels(self, prefix: str) -> None:
        self.workers.call_all(InferenceWorker.forget_channels, prefix)

    def offload(self) -> None:
        self.workers.call_all(InferenceWorker.offload)

    def onload(self) -> None:
        self.workers.call_all(InferenceWorker.onload)

    def close(self, wait_s: float = 10.0) -> None:
        self.workers.close(wait_s)
        if self._outbox is not None:
            self._outbox.close()
