"""Pure, vectorised RL math on trajectory tensors: no modules, no processes, no configuration files.

* :mod:`~embodirl.algorithms.advantages` - advantage estimators keyed by ``algorithm.adv_type``
  (``gae``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ``remax``);
* :mod:`~embodirl.algorithms.losses` - clipped policy loss, clipped value loss, entropy bonus and the
  full PPO/GRPO objective of one micro-batch;
* :mod:`~embodirl.algorithms.kl` - KL estimators to the reference policy and the fixed/adaptive
  coefficient controller;
* :mod:`~embodirl.algorithms.aggregation` - loss reductions (``algorithm.loss_agg_func``) that give
  the same gradient whatever the micro-batch and data-parallel split;
* :mod:`~embodirl.algorithms.filtering` - group filtering by success rate.

Everything here imports only torch and :mod:`embodirl.data`.
"""
