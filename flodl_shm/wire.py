"""Public alias of :mod:`flodl_shm.cluster.wire` (the documented ``flodl_shm.wire`` path).

The wire codec lives with the cluster layer that uses it; this module keeps the
contract's import path, ``from flodl_shm.wire import write_round_frame``, working.
"""
from .cluster.wire import *  # noqa: F401,F403
from .cluster.wire import __all__  # noqa: F401
