"""The shared-memory substrate's internal API: what a kind of shmbuf object (pipeline, weight broadcast,
inference table, replay buffer) is built from. One import point; each name's guarantee is in the table
of docs/design/segment.md. The names live in the modules of one concept each that this re-exports.
"""

from __future__ import annotations

from shmbuf._closable import Closable
from shmbuf._fork import track
from shmbuf._janitor import keeping
from shmbuf._names import (
    INFERENCE_PREFIX,
    PREFIX,
    SHM_DIR,
    WEIGHTS_PREFIX,
    check_name,
    entry_pattern,
    new_name,
    sem_name,
)
from shmbuf._ofd import BUSY, LOCK_BASE, apply, held, lock, packed
from shmbuf._pidwatch import ProcessWatch
from shmbuf._proc import Owner, alive, this_process
from shmbuf._ring import Fence, fence, store_load_fence
from shmbuf._schema import ALIGN
from shmbuf._schema import _align as align  # every region of an object starts at a multiple of ALIGN (64)
from shmbuf._shm import (
    HEAD,
    HEADER_BYTES,
    check_head,
    create_object,
    fmt_bytes,
    leaf_major,
    map_object,
    pinned,
    populated,
    unlink_object,
    unlink_semaphore,
    unmap,
    write_header,
)
from shmbuf._trust import check_semaphore, open_object, path_problem

__all__ = [  # grouped by concept, as the table in docs/design/segment.md
    # names (shmbuf._names)
    "PREFIX", "WEIGHTS_PREFIX", "INFERENCE_PREFIX", "SHM_DIR", "new_name", "sem_name", "check_name", "entry_pattern",
    # trust checks (shmbuf._trust)
    "open_object", "check_semaphore", "path_problem",
    # create, map, header (shmbuf._shm)
    "HEAD", "HEADER_BYTES", "ALIGN", "align", "create_object", "leaf_major", "map_object", "populated", "check_head",
    "write_header", "pinned", "unmap", "unlink_object", "unlink_semaphore", "fmt_bytes",
    # locks and liveness (shmbuf._ofd, shmbuf._pidwatch, shmbuf._proc)
    "LOCK_BASE", "BUSY", "lock", "held", "packed", "apply", "ProcessWatch", "Owner", "this_process", "alive",
    # ordering (shmbuf._ring; docs/design/memory-ordering.md)
    "Fence", "fence", "store_load_fence",
    # lifetime (shmbuf._closable, shmbuf._fork, shmbuf._janitor)
    "Closable", "track", "keeping",
]
