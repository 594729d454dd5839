"""Demonstrations: LeRobot datasets on disk (:mod:`embodirl.demos.lerobot_format`) and motion-planner demos
for ManiSkill tasks (:mod:`embodirl.demos.generate`, the ``embodirl demos`` command)."""

from embodirl.demos.lerobot_format import DatasetError, EpisodeData, FeatureStats, LeRobotDataset, LeRobotWriter, Sample

__all__ = ["DatasetError", "EpisodeData", "FeatureStats", "LeRobotDataset", "LeRobotWriter", "Sample"]
