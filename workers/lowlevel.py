"""workers' lower tier: the parts the collectors are built from, public and supported, for a program that owns its
processes or builds its own collector (the env driver, actor-side views, the inference server and the env worker's
remote policy, the thread pool, weights application, the start method pools use, and the multi-agent loop with the
``Episode`` a per-episode policy mapping is given).

``NodeOwner`` (the Ray node's collector) is imported on first use, as the Ray names at the top level are (and,
like them, is not in ``__all__``), so that importing this module never imports ray.
"""

from workers._agent_rows import Episode
from workers._envs import EnvDriver
from workers._multiagent import MultiAgentLoop, multiagent_examples
from workers._policy import apply_weights
from workers._pool import default_start_method
from workers._remote import RemotePolicy
from workers._server import InferenceServer
from workers._threadpool import ThreadActorPool
from workers._views import ActorViews

__all__ = [
    "ActorViews",
    "EnvDriver",
    "Episode",
    "InferenceServer",
    "MultiAgentLoop",
    "RemotePolicy",
    "ThreadActorPool",
    "apply_weights",
    "default_start_method",
    "multiagent_examples",
]


def __getattr__(name: str) -> object:
    if name == "NodeOwner":
        try:
            from workers import _ray_nodes
        except ImportError as exc:
            raise ImportError(f"workers.lowlevel.{name} needs Ray: pip install 'shmbuf[ray]' ({exc})") from exc
        return _ray_nodes.NodeOwner
    raise AttributeError(f"module 'workers.lowlevel' has no attribute {name!r}")
