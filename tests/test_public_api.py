"""The public API is exactly what __all__ says: a change to it is a decision, not an accident."""

import shmbuf


def test_public_names_are_pinned() -> None:
    assert sorted(shmbuf.__all__) == sorted([
        "ActorError", "Batch", "BrokenPipeline", "BufferEmpty", "BufferFull", "Handle", "InferenceClient", "InferenceTable", "Leaf", "NoSpace", "PipelineClosed", "Reader", "Rollout", "Schema",
        "SchemaError", "SegmentError", "ShmbufError", "SlotTimeout", "StaleRollout", "Timescale", "TimescaleFull",
        "UnknownTimescale", "UsageError", "WeightPublisher",
        "WeightSubscriber", "WeightsHandle", "Writer",
        "WriterError", "WrongProcess", "__version__", "create",
    ])
    for name in shmbuf.__all__:
        assert hasattr(shmbuf, name)


def test_errors_subclass_the_builtins_a_caller_would_catch() -> None:
    assert issubclass(shmbuf.SchemaError, ValueError) and issubclass(shmbuf.SegmentError, ValueError)
    assert issubclass(shmbuf.SlotTimeout, TimeoutError) and issubclass(shmbuf.NoSpace, OSError)
    for e in (shmbuf.PipelineClosed, shmbuf.BrokenPipeline, shmbuf.StaleRollout, shmbuf.WriterError, shmbuf.WrongProcess):
        assert issubclass(e, RuntimeError) and issubclass(e, shmbuf.ShmbufError)
    assert issubclass(shmbuf.UsageError, ValueError) and issubclass(shmbuf.UsageError, TypeError)
    assert issubclass(shmbuf.TimescaleFull, IndexError) and issubclass(shmbuf.UnknownTimescale, KeyError)
    for e in (shmbuf.UsageError, shmbuf.TimescaleFull, shmbuf.UnknownTimescale, shmbuf.SchemaError, shmbuf.SegmentError):
        assert issubclass(e, shmbuf.ShmbufError)


def test_storage_public_names_are_pinned() -> None:
    import shmbuf.storage

    assert sorted(shmbuf.storage.__all__) == sorted([
        "BufferEmpty", "BufferFull", "Field", "FileTransition", "MaskedView", "MiniBatch", "Recorder", "RolloutDataset", "QueueRolloutStorage", "ReplayBuffer", "ReplayHandle", "ReplayInfo",
        "RolloutBuffer", "RolloutBufferWriter", "RolloutSlot", "RolloutStorage", "SarsaMiniBatch", "SarsaRolloutStorage",
        "SarsaTransition", "TimeOutObservations", "Transition", "ViewRequirement", "build_views", "compute_gae",
        "get_frame_range", "iterate_minibatches", "normalize_advantages", "parse_shift", "play", "playback_example",
        "read_metadata", "split_and_pad_trajectories", "to_torch",
        "transition_view", "unpad_trajectories",
    ])
    for name in shmbuf.storage.__all__:
        assert hasattr(shmbuf.storage, name)



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
