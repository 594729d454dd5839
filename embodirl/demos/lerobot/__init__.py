"""LeRobot datasets on disk (the v2.0/v2.1 layout): a writer and a reader, without torch or torchvision.

Layout (LeRobot ``codebase_version`` v2.1, the paths of lerobot v0.3.3 ``lerobot/datasets/utils.py``)::

    <root>/meta/info.json               fps, features (dtype/shape/names), path templates, totals
    <root>/meta/episodes.jsonl          {"episode_index", "tasks": [str], "length"} per episode
    <root>/meta/tasks.jsonl             {"task_index", "task"} per instruction
    <root>/meta/episodes_stats.jsonl    {"episode_index", "stats": {feature: {min, max, mean, std, count}}}
    <root>/meta/stats.json              dataset stats per feature (min, max, mean, std, count, q01, q99)
    <root>/data/chunk-000/episode_000000.parquet     one row per frame: action, observation.state,
                                                     timestamp, frame_index, episode_index, index, task_index
    <root>/videos/chunk-000/observation.images.<camera>/episode_000000.mp4   one mp4 per camera and episode

Why not the ``lerobot`` package: it depends on torchvision; its standalone spin-off (``lerobot-dataset``) pins
numpy/huggingface-hub/datasets below this project's versions. pyarrow reads the parquet frames, PyAV
encodes and decodes the videos.

Videos: :class:`LeRobotWriter` encodes with ``libx264rgb`` at ``crf 0`` by default - lossless RGB H.264,
so the frames read back are exactly those recorded (the policy trains on the pixels the simulator
renders). ``video_codec="h264"`` writes the usual lossy ``yuv420p`` H.264 instead (smaller, not exact).
The reader decodes any codec FFmpeg knows (LeRobot's own ``libsvtav1`` included) and also reads
``image`` features stored in the parquet files (PNG/JPEG bytes, as some published datasets do).

Reading (the API the SFT path uses)::

    ds = LeRobotDataset("outputs/demos/PushCube-v1", action_chunk=8)
    len(ds)                     # frames, all episodes together
    s = ds[i]                   # Sample: images {camera key: uint8 [h, w, 3]}, proprio float32 [S] | None,
                                #   instruction str, actions float32 [H, A], action_mask bool [H],
                                #   episode_index, frame_index, index
    ds.stats["action"].q01      # per-dim float32 arrays: mean, std, min, max, q01, q99 (also "observation.state")
    ds.all_actions()            # every frame's action, float32 [N, A], row i = sample i (read-only)
    ds.all_proprio()            # every frame's observation.state, float32 [N, S] (read-only), None without proprio
    ds.episode(e)               # a whole episode: EpisodeData (images [T, h, w, 3] per camera, actions, states, task)

The action chunk of frame t is ``actions[t : t + H]`` of its episode; rows past the episode's end repeat
its last action and have ``action_mask`` False (LeRobot's ``action_is_pad`` convention, inverted: True
marks a real row). A missing or corrupt file raises :class:`~embodirl.demos.lerobot.layout.DatasetError`, one
sentence naming the file.
"""
