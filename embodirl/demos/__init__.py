"""Demonstrations: LeRobot datasets on disk (:mod:`embodirl.demos.lerobot`: the layout, a reader and a writer) and
scripted-expert demos for ManiSkill tasks (:mod:`embodirl.demos.generate`, the ``embodirl demos`` command)."""
