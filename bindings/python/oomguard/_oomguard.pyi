# Type stub of the compiled module oomguard._oomguard. The classes are
# described in their docstrings and in docs/python.md; this stub is partial
# (attribute access is typed as Any) so that `py.typed` does not promise more
# than it states.
from typing import Any

__version__: str
EXIT_COORDINATION_TIMEOUT: int
CHECKPOINT_FORMAT: str

def __getattr__(name: str) -> Any: ...
