"""Imported once by the forkserver that starts ManiSkill simulator processes (``ProcessVectorEnv``'s
``preload``): every simulator process is then forked with the Vulkan set-up done and gymnasium, SAPIEN
and ManiSkill's task registry imported, instead of importing them itself. On 2 cores this cuts the start
of 16 PushCube processes several-fold and their private memory by ~45 % (measured side by side in the
commit that added it). Nothing here creates a render device or a scene: those stay per
process (SAPIEN's contexts do not survive a fork)."""

from embodirl.runtime import configure

configure()

import gymnasium  # noqa: E402,F401
import mani_skill.envs  # noqa: E402,F401 - registers the tasks
