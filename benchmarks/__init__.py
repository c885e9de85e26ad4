"""shmbuf's benchmarks against echo's TCP transport, multiprocessing.Queue and faster_fifo.

Run ``python benchmarks/run.py [--quick]`` from the repository root (or ``shmbuf bench``).
"""
