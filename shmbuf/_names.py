"""Names of shmbuf objects: how they are made, what they look like, and the one table of their patterns.

Every shared-memory object and semaphore shmbuf makes has a name from here, and every name that
comes in from outside (a handle, a command line, an entry found in /dev/shm) is checked here
before it reaches posix_ipc or the file system. See docs/design/segment.md.
"""

from __future__ import annotations

import re
import secrets

from shmbuf._errors import UsageError

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory, and named semaphores as sem.<name>
PREFIX = "/shmbuf-"  # a pipeline (and a replay buffer, which has its own magic)
WEIGHTS_PREFIX = PREFIX + "w"
INFERENCE_PREFIX = PREFIX + "i"

_HEX = "[0-9a-f]{16}"
# The one table of name patterns, without the leading "/": object names by kind, and the semaphores
# named after them (a pipeline's doorbell -r and lanes' free counts -f<lane>; an inference table's
# server doorbell -s and clients' answer counts -c<client>). Entries in /dev/shm are these names,
# semaphores with "sem." in front.
_OBJECTS = {
    "pipeline": f"shmbuf-({_HEX})",
    "weights": f"shmbuf-w({_HEX})",
    "inference": f"shmbuf-i({_HEX})",
}
# Semaphores: the object's name, "-", a role; {n} is the lane's or client's number.
_SEMS = {
    "pipeline": (_OBJECTS["pipeline"], "r|f{n}"),
    "inference": (_OBJECTS["inference"], "s|c{n}"),
}
_ANY_NUMBER = r"\d+"
_NAMES = {kind: re.compile("/" + p) for kind, p in _OBJECTS.items()}
_NAMES["any"] = re.compile(f"/shmbuf-[wi]?{_HEX}")
_SEM_NAME = re.compile(
    "|".join(f"/{obj}-({roles.format(n=digits)})"
             for (obj, roles), digits in zip(_SEMS.values(), ("[0-9]{1,3}", "[0-9]{1,4}")))
)


def entry_pattern(kind: str, *, semaphore: bool = False) -> re.Pattern[str]:
    """The pattern of an entry of /dev/shm: an object of ``kind``, or (``semaphore``) one of its semaphores.

    Group 1 is the object's 16 hex digits; a semaphore's group 2 is its role (``r``, ``f3``, ``s``, ``c0``).
    Lane and client numbers are not bounded here (``shmbuf ls`` lists whatever it finds).
    """
    if not semaphore:
        return re.compile(f"^{_OBJECTS[kind]}$")
    obj, roles = _SEMS[kind]
    return re.compile(rf"^sem\.{obj}-({roles.format(n=_ANY_NUMBER)})$")


def new_name(prefix: str = PREFIX) -> str:
    """``prefix`` (``/shmbuf-``, ``/shmbuf-w`` or ``/shmbuf-i``) and 16 hex digits (64 random bits).

    A pipeline's is 24 characters: room for semaphore suffixes under macOS's 31.
    """
    return prefix + secrets.token_hex(8)


def sem_name(name: str, role: str) -> str:
    """Semaphore names derive from their object's: ``-r`` a pipeline's doorbell, ``-f<lane>`` a lane's free
    count; ``-s`` an inference table's server doorbell, ``-c<client>`` a client's answers."""
    return f"{name}-{role}"


def shm_path(name: str) -> str:
    """Where the object ``name`` (already checked) lives in the file system."""
    return f"{SHM_DIR}/{name[1:]}"


def sem_path(sem: str) -> str:
    """Where the semaphore ``sem`` (already checked) lives in the file system."""
    return f"{SHM_DIR}/sem.{sem[1:]}"


def what(name: str) -> str:
    """The kind of object a name is, as messages say it."""
    return "weight broadcast" if name.startswith(WEIGHTS_PREFIX) else "pipeline"


def check_name(name: object, kind: str = "pipeline") -> str:
    """Return ``name`` if it is a shmbuf name of that kind, else raise UsageError saying what one looks like.

    ``kind``: ``"pipeline"`` (``/shmbuf-`` and 16 lowercase hex digits, what :func:`new_name`
    makes), ``"weights"`` (``/shmbuf-w`` and 16), ``"inference"`` (``/shmbuf-i`` and 16) or ``"any"``.
    Every name is checked here before it reaches posix_ipc or the file system: a NUL byte crashes
    posix_ipc (SIGSEGV), a ``/`` or more than 255 characters is a bare ValueError there, and ``..``
    would leave /dev/shm.
    """
    if isinstance(name, str) and _NAMES[kind].fullmatch(name):
        return name
    got = f"{name!r:.80}" if isinstance(name, str) else f"a {type(name).__name__}"
    if kind == "inference":
        raise UsageError(
            f"an inference table name starts with '{INFERENCE_PREFIX}' followed by 16 lowercase hex digits, as "
            f"InferenceTable makes it (table.name); got {got}"
        )
    if kind == "weights":
        raise UsageError(
            f"a weight broadcast name starts with '{WEIGHTS_PREFIX}' followed by 16 lowercase hex digits, as "
            f"WeightPublisher makes it (publisher.name or publisher.handle); got {got}"
        )
    raise UsageError(
        f"a shmbuf pipeline name starts with '{PREFIX}' followed by 16 lowercase hex digits, as shmbuf.create "
        f"makes it (reader.name or reader.handle); got {got}"
    )


def check_sem_name(sem: object) -> str:
    """Return ``sem`` if it is a shmbuf semaphore name, else raise UsageError."""
    if isinstance(sem, str) and _SEM_NAME.fullmatch(sem):
        return sem
    raise UsageError(f"expected a shmbuf semaphore name ('{PREFIX}' + 16 hex digits + '-r' or '-f<lane>'), got {sem!r:.80}")
