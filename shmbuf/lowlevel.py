"""shmbuf's lower tier: names a program needs only when it builds its own machinery on the core.

The top level (``shmbuf``) holds what the README and docs use; this tier holds the rest, public and
supported: the schema's parts, the batched-inference table that ``workers.AsyncBatchedCollector`` is
built on, and the settings validators every entry point uses (so that code above the core checks its
settings with the same rules and messages).
"""

from shmbuf._handle import InferenceHandle
from shmbuf._inference import InferenceTable
from shmbuf._inference_client import InferenceClient
from shmbuf._schema import Leaf, Timescale
from shmbuf._validate import int_setting, name_setting, timeout_setting

__all__ = [
    "InferenceClient",
    "InferenceHandle",
    "InferenceTable",
    "Leaf",
    "Timescale",
    "int_setting",
    "name_setting",
    "timeout_setting",
]
