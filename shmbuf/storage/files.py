"""Rollouts to and from files: a :class:`Recorder` that writes trajectories to a directory, a
:class:`RolloutDataset` that serves them back (the ``rollout_files`` of rsl_rl's legged-robot forks), and
:func:`play`, which feeds them into a shmbuf pipeline in the workers rollout layout.

The names live in their own modules and are imported here, where they have always been importable:

- :mod:`shmbuf.storage._fileformat`: the on-disk format, the ``.npy`` header parser, the JSON checks and
  the trust checks on opening files; :func:`read_metadata`.
- :mod:`shmbuf.storage.recorder`: :class:`Recorder`, which reads its input through
  :func:`shmbuf.layout.grid` (in :mod:`shmbuf.storage._rollout_units`, which checks what it is given and
  cuts it into per-lane units).
- :mod:`shmbuf.storage._file_base`: :class:`RolloutFileBase`, the forks' abstract reader to subclass.
- :mod:`shmbuf.storage.dataset`: :class:`RolloutDataset` (a RolloutFileBase), :class:`FileTransition`,
  :func:`get_frame_range`.
- :mod:`shmbuf.storage.playback`: :func:`play`, :func:`playback_example`.
- :mod:`shmbuf.storage._pickled`: the forks' own pickled recordings, read only with ``allow_pickle=True``
  (:func:`read_pickled_recording`) and converted once into this format (:func:`convert_pickled_recording`,
  ``shmbuf convert --allow-pickle SRC DST``).

See docs/files.md for the mapping of the forks' names.
"""

from shmbuf.storage._file_base import RolloutFileBase
from shmbuf.storage._fileformat import read_metadata
from shmbuf.storage._pickled import convert_pickled_recording, read_pickled_recording
from shmbuf.storage.dataset import FileTransition, RolloutDataset, get_frame_range
from shmbuf.storage.playback import play, playback_example
from shmbuf.storage.recorder import Recorder

__all__ = ["FileTransition", "Recorder", "RolloutDataset", "RolloutFileBase", "convert_pickled_recording", "get_frame_range",
           "play", "playback_example", "read_metadata", "read_pickled_recording"]
