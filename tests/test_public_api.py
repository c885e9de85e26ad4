"""The public API is exactly what __all__ says: a change to it is a decision, not an accident."""

import importlib
import pathlib

import pytest

import shmbuf

# Every public tier, pinned: the top levels hold what the README and docs use (issue 20 aims: shmbuf <= 30,
# workers <= 16 with its Ray names, shmbuf.storage <= 25); the rest sits in a lowlevel tier.
TIERS = {
    "shmbuf": [
        "ActorError", "Batch", "BrokenPipeline", "BufferEmpty", "BufferFull", "Handle", "NoSpace", "PipelineClosed",
        "Reader", "Rollout", "Schema", "SchemaError", "SegmentError", "ShmbufError", "SlotTimeout", "StartTimeout",
        "StaleRollout", "StateError",
        "TimescaleFull", "UnknownTimescale", "UsageError", "WeightPublisher", "WeightSubscriber", "WeightsHandle",
        "Writer", "WriterError", "WrongProcess", "__version__", "create",
    ],
    "shmbuf.lowlevel": [
        "InferenceClient", "InferenceHandle", "InferenceTable", "Leaf", "Timescale", "int_setting", "name_setting",
        "timeout_setting",
    ],
    "shmbuf.layout": [
        "ACTION", "BATCH_MODES", "BOOTSTRAP", "COMPLETE_EPISODES", "END", "ENV", "ENV_STEPS", "EPISODE", "FINAL_OBS",
        "FLAG_KEYS", "Grid", "LENGTH", "OBS", "RETURN", "REWARD", "STEP", "STEP_KEYS", "TERMINATED", "TRUNCATED",
        "TRUNCATE_EPISODES", "VALID", "EpisodeTable", "check_batch_mode", "grid", "rollout_example", "successors",
        "zeros_with_lead",
    ],
    # The neutral engines (TimeMajorStorage, SlotBuffer) and rsl_rl's and embodichain's names, re-exported from their façades.
    "shmbuf.storage": [
        "Field", "FileTransition", "MaskedView", "MiniBatch", "QueueRolloutStorage", "Recorder", "ReplayBuffer",
        "RolloutBuffer", "RolloutDataset", "RolloutStorage", "SarsaRolloutStorage", "SlotBuffer", "TimeMajorStorage",
        "TimeOutObservations", "Transition", "ViewRequirement", "build_views", "compute_gae", "iterate_minibatches",
        "normalize_advantages", "play", "split_and_pad_trajectories", "to_torch", "transition_view", "unpad_trajectories",
    ],
    "shmbuf.storage.rollout": [
        "ActorCriticHiddenState", "MiniBatch", "TimeMajorStorage", "TimeOutObservations", "Transition",
        "split_and_pad_trajectories", "unpad_trajectories",
    ],
    "shmbuf.storage.buffer": [
        "BufferEmpty", "BufferFull", "Field", "RolloutBufferWriter", "RolloutSlot", "SlotBuffer", "iterate_minibatches",
        "to_torch", "transition_view",
    ],
    # One façade per framework: its names, defined there or re-exported from the room that holds them.
    "shmbuf.storage.compat.rsl_rl": [
        "ActionLabelMiniBatch", "ActionLabelRollout", "ActionLabelTransition", "ActorCriticHiddenState", "FileTransition",
        "LocalReplayBuffer", "MiniBatch", "QueueRolloutStorage", "ReplayBuffer", "RolloutDataset", "RolloutFileBase",
        "RolloutStorage", "SarsaMiniBatch", "SarsaRolloutStorage", "SarsaTransition", "TimeOutObservations", "Transition",
        "convert_pickled_recording", "get_frame_range", "read_pickled_recording", "split_and_pad_trajectories",
        "unpad_trajectories",
    ],
    "shmbuf.storage.compat.embodichain": ["RolloutBuffer", "default_fields", "iterate_minibatches", "transition_view"],
    "shmbuf.storage.lowlevel": [
        "LocalReplayBuffer",
        "ReplayHandle", "ReplayInfo", "RolloutBufferWriter", "RolloutSlot", "get_frame_range", "parse_shift",
        "playback_example", "read_metadata",
    ],
    "workers": [
        "ActorContext", "ActorError", "ActorLoop", "ActorPool", "ActorSpec", "AsyncBatchedCollector", "CollectSettings",
        "CollectedBatch", "Collector", "MultiAgentBatch", "MultiAgentCollector", "probe", "run_actor",
    ],
    "workers.lowlevel": [
        "ActorViews", "EnvDriver", "Episode", "InferenceServer", "MultiAgentLoop", "RemotePolicy", "ThreadActorPool",
        "apply_weights", "default_start_method", "multiagent_examples",
    ],
}
# Imported on first use (they import ray), so outside __all__.
RAY_NAMES = {"workers": ("NodeFailure", "RayBatch", "RayCollector"), "workers.lowlevel": ("NodeOwner",)}


@pytest.mark.parametrize("module", sorted(TIERS))
def test_public_names_are_pinned(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(TIERS[module])
    for name in mod.__all__:
        assert hasattr(mod, name)


def test_top_levels_stay_small() -> None:
    assert len(TIERS["shmbuf"]) <= 30 and len(TIERS["shmbuf.storage"]) <= 25
    assert len(TIERS["workers"]) + len(RAY_NAMES["workers"]) <= 16


def test_the_ray_names_are_there_and_lazy() -> None:
    """``workers.RayCollector`` and the rest resolve (they import ray, which the test extra has) but stay out of __all__."""
    for module, names in RAY_NAMES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert name not in mod.__all__ and getattr(mod, name).__name__ == name


MOVED = {
    "shmbuf": {"InferenceClient": "shmbuf.lowlevel", "InferenceTable": "shmbuf.lowlevel", "Leaf": "shmbuf.lowlevel",
               "Timescale": "shmbuf.lowlevel"},
    "shmbuf.storage": {"BufferEmpty": "shmbuf", "BufferFull": "shmbuf", "ReplayHandle": "shmbuf.storage.lowlevel",
                       "ReplayInfo": "shmbuf.storage.lowlevel", "RolloutBufferWriter": "shmbuf.storage.lowlevel",
                       "RolloutSlot": "shmbuf.storage.lowlevel", "get_frame_range": "shmbuf.storage.lowlevel",
                       "parse_shift": "shmbuf.storage.lowlevel", "playback_example": "shmbuf.storage.lowlevel",
                       "read_metadata": "shmbuf.storage.lowlevel", "SarsaMiniBatch": "shmbuf.storage.compat.rsl_rl",
                       "SarsaTransition": "shmbuf.storage.compat.rsl_rl"},
    "shmbuf.storage.rollout": {name: "shmbuf.storage.compat.rsl_rl" for name in (
        "ActionLabelMiniBatch", "ActionLabelRollout", "ActionLabelTransition", "QueueRolloutStorage", "RolloutStorage",
        "SarsaMiniBatch", "SarsaRolloutStorage", "SarsaTransition")},
    "shmbuf.storage.buffer": {"RolloutBuffer": "shmbuf.storage.compat.embodichain",
                              "default_fields": "shmbuf.storage.compat.embodichain"},
    "workers": {"ActorViews": "workers.lowlevel", "EnvDriver": "workers.lowlevel", "InferenceServer": "workers.lowlevel",
                "NodeOwner": "workers.lowlevel", "RemotePolicy": "workers.lowlevel", "ThreadActorPool": "workers.lowlevel",
                "apply_weights": "workers.lowlevel", "default_start_method": "workers.lowlevel",
                "rollout_example": "shmbuf.layout", "successors": "shmbuf.layout",
                "to_tensordict": "workers.compat.torchrl"},
}


@pytest.mark.parametrize("module", sorted(MOVED))
def test_moved_names_still_import_with_a_warning_naming_their_new_home(module: str) -> None:
    mod = importlib.import_module(module)
    for name, home in MOVED[module].items():
        with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} moved to {home}\.{name}"):
            got = getattr(mod, name)
        assert got is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        mod.Nothing  # noqa: B018  # the attribute access is the test


def test_changelog_lists_every_moved_name() -> None:
    text = (pathlib.Path(__file__).parent.parent / "CHANGELOG.md").read_text()
    missing = [f"{m}.{n}" for m, names in MOVED.items() for n in names if f"`{m}.{n}`" not in text]
    assert not missing, f"CHANGELOG.md does not list: {missing}"


def test_errors_subclass_the_builtins_a_caller_would_catch() -> None:
    assert issubclass(shmbuf.SchemaError, ValueError) and issubclass(shmbuf.SegmentError, ValueError)
    assert issubclass(shmbuf.SlotTimeout, TimeoutError) and issubclass(shmbuf.NoSpace, OSError)
    for e in (shmbuf.PipelineClosed, shmbuf.BrokenPipeline, shmbuf.StaleRollout, shmbuf.WriterError, shmbuf.WrongProcess):
        assert issubclass(e, RuntimeError) and issubclass(e, shmbuf.ShmbufError)
    assert issubclass(shmbuf.UsageError, ValueError) and issubclass(shmbuf.UsageError, TypeError)
    assert issubclass(shmbuf.TimescaleFull, IndexError) and issubclass(shmbuf.UnknownTimescale, KeyError)
    for e in (shmbuf.UsageError, shmbuf.TimescaleFull, shmbuf.UnknownTimescale, shmbuf.SchemaError, shmbuf.SegmentError):
        assert issubclass(e, shmbuf.ShmbufError)


def test_storage_imports_neither_workers_nor_torch() -> None:
    """The learner-side package is numpy-only at import, and never reaches up into workers/ (a fresh interpreter)."""
    import subprocess
    import sys

    code = "import sys, shmbuf.storage; print(sorted(m for m in ('torch', 'workers', 'gymnasium', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_workers_imports_ray_only_when_asked() -> None:
    """Ray is an optional extra: `import workers` never imports it; `workers.RayCollector` does (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import sys, workers; before = 'ray' in sys.modules; workers.RayCollector; "
            "print(before, 'ray' in sys.modules, sorted(set(workers._RAY_NAMES) - set(workers.__all__)) == "
            "sorted(workers._RAY_NAMES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "True", "True"], out.stderr
