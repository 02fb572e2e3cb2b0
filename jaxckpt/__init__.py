"""jaxckpt: a functional checkpoint manager for JAX.

Save sharded PyTrees with every process writing only its own shards through
tensorstore, restore them onto any mesh, and manage steps with retention and async
commits.
"""

from . import convert as convert
from . import policies as policies
from ._checkpoint import CheckpointInfo as CheckpointInfo
from ._checkpoint import LeafInfo as LeafInfo
from ._checkpoint import metadata as metadata
from ._checkpoint import save as save
from ._diff import DiffReport as DiffReport
from ._diff import LeafStats as LeafStats
from ._diff import diff as diff
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CorruptCheckpointError as CorruptCheckpointError
from ._errors import TreeMismatchError as TreeMismatchError
from ._layout import SavedSharding as SavedSharding
from ._manager.cadence import CadenceAdvice as CadenceAdvice
from ._manager.history import History as History
from ._manager.history import HistoryRecord as HistoryRecord
from ._manager.history import history as history
from ._manager.manager import CheckpointManager as CheckpointManager
from ._placement import PlacementWarning as PlacementWarning
from ._plot import plot_history as plot_history
from ._quantize import Quantize as Quantize
from ._restore import MissingKeysWarning as MissingKeysWarning
from ._restore import restore as restore
from ._verify import VerifyReport as VerifyReport
from ._verify import verify as verify
from ._version import __version__ as __version__
from .inspect import CheckpointView as CheckpointView
from .inspect import LazyArray as LazyArray
from .inspect import open as open  # noqa: A004

__all__ = [
    "CadenceAdvice",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointView",
    "CorruptCheckpointError",
    "DiffReport",
    "History",
    "HistoryRecord",
    "LazyArray",
    "LeafInfo",
    "MissingKeysWarning",
    "PlacementWarning",
    "Quantize",
    "LeafStats",
    "SavedSharding",
    "TreeMismatchError",
    "VerifyReport",
    "__version__",
    "convert",
    "policies",
    "diff",
    "history",
    "metadata",
    "open",
    "plot_history",
    "restore",
    "save",
    "verify",
]
