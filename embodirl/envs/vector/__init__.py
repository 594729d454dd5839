"""Single simulators lifted into a batch: ``vector_env`` (:class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv`,
one process per simulator), ``episodes`` (one simulator's episode semantics), ``subproc`` (the process transport) and
``recovery`` (crashed and hung simulators replaced)."""
