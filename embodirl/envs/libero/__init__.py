"""LIBERO (robosuite 1.4 + MuJoCo) as an embodirl simulator, following OpenVLA-OFT's LIBERO evaluation protocol:
``simulator`` (the :class:`~embodirl.envs.base.SimEnv` and the ``libero`` adapter), ``suite`` (a suite's tasks, BDDL
files and init states), ``patches`` (cheaper episodes with the same observations), ``paths`` (the asset folder and
LIBERO's config file, without its first-run prompt) and ``manifest`` (LIBERO's files checked against upstream's git
tree)."""
