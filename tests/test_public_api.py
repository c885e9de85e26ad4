"""The public API is exactly what __all__ says: a change to it is a decision, not an accident."""

import shmbuf


def test_public_names_are_pinned() -> None:
    assert sorted(shmbuf.__all__) == sorted([
        "Batch", "BrokenPipeline", "Handle", "Leaf", "NoSpace", "PipelineClosed", "Reader", "Rollout", "Schema",
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
