"""Process-level helpers on top of shmbuf: actor loops, actor pools, a collector."""

__all__: list[str] = []
